"""The daemon: grpc.aio servicers over one ``TieredStore``.

``server`` (Daemon, start, serve) composes ``kv_service`` (KVStore),
``admin_service`` (Admin) and ``cluster_service`` (Cluster) over ``state``
(DaemonState, store_config); every unary call goes through ``rpc`` (auth,
QoS, deadlines, metrics, status codes), the gRPC ones and those of the
same-host ``socket_server`` alike. ``auth``, ``events``, ``metrics`` and
``peers`` (the cluster node) are its parts. Imports point down: daemon ->
core, wire, admission, transport; never the client.
"""
