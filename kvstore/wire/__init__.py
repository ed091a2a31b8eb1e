"""What both ends agree on: ``convert`` (proto <-> Python: namespaces, keys,
tiers, slots), ``status`` (the one exception <-> gRPC code table),
``frames`` (the same-host socket's frames), ``answers`` (protobuf answers ->
typed results), ``shm`` and ``hbm_ipc`` (shared-memory and HBM IPC
descriptors). Nothing here imports the daemon or the client.
"""
