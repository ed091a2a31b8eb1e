"""The one status table: exception class <-> gRPC status code, both ways.

The daemon answers a ``KVStoreError`` with ``status_for(exc)`` (the gRPC
servicers and the same-host socket alike); a client turns a failed call's
code back into the exception-tree class with ``error_for(code, detail)``.
Codes outside the table: INTERNAL on the way out; ``Unavailable`` on the way
in (a transport failure or a daemon bug is something to retry elsewhere,
never a crash of the caller).
"""

from __future__ import annotations

from typing import Any

import grpc

from kvstore import errors
from kvstore.errors import KVStoreError

STATUS_TABLE: dict[type[KVStoreError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}
"""Exception class -> gRPC status. The only place codes are chosen."""

ERROR_FOR_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {code: cls for cls, code in STATUS_TABLE.items()}
"""gRPC status -> exception class (the inverse of ``STATUS_TABLE``)."""

_BY_VALUE: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status a failed call answers with (INTERNAL for anything that is
    not in the exception tree)."""
    for cls in type(exc).__mro__:
        code = STATUS_TABLE.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def code_from_value(value: int) -> grpc.StatusCode:
    """A status from its integer value (the same-host socket's error frame)."""
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def error_for(code: grpc.StatusCode | None, detail: str) -> KVStoreError:
    """The exception for a call that failed with ``code``; the message keeps
    the code's name in front (``"NOT_FOUND: ..."``)."""
    cls = ERROR_FOR_CODE.get(code, errors.Unavailable) if code is not None else errors.Unavailable
    return cls(f"{code.name if code is not None else 'ERROR'}: {detail}")


def error_from_rpc(e: grpc.RpcError | Any) -> KVStoreError:
    """The exception-tree class for a failed gRPC call."""
    code = e.code() if hasattr(e, "code") else None
    detail = e.details() if hasattr(e, "details") else str(e)
    return error_for(code, detail)
