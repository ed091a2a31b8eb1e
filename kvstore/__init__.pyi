# The typed face of kvstore/__init__.py, whose names load lazily (module __getattr__).
# Keep the two in step: tests/unit/kvstore/test_package.py checks they name the same things.
from kvstore import checksum as checksum, config as config, errors as errors, keys as keys, results as results
from kvstore.client import AsyncClient as AsyncClient, Client as Client, Lease as Lease, Reservation as Reservation
from kvstore.config import Config as Config, load_config as load_config, parse_size as parse_size
from kvstore.core.store import StoreConfig as StoreConfig, TieredStore as TieredStore
from kvstore.errors import (CapacityError as CapacityError, DataLoss as DataLoss, DeadlineExceeded as DeadlineExceeded,
                            InvalidArgument as InvalidArgument, KeyStatus as KeyStatus, KVStoreError as KVStoreError,
                            NotFound as NotFound, PermissionDenied as PermissionDenied,
                            Unauthenticated as Unauthenticated, Unavailable as Unavailable)
from kvstore.keys import (HashAlgo as HashAlgo, KVDtype as KVDtype, KVLayout as KVLayout, Namespace as Namespace,
                          block_keys as block_keys, block_keys_array as block_keys_array,
                          first_divergence as first_divergence)

__version__: str
__all__: list[str]
