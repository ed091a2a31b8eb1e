"""The one status table (kvstore.wire.status): every exception of the tree
maps to its gRPC code, and every code maps back to the same class."""

from __future__ import annotations

import grpc
import pytest

from kvstore import errors
from kvstore.errors import KVStoreError
from kvstore.wire.status import (ERROR_FOR_CODE, STATUS_TABLE, code_from_value, error_for, error_from_rpc,
                                 status_for)

EXPECTED = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


def test_every_subclass_of_the_tree_is_in_the_table() -> None:
    tree = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, KVStoreError)}
    assert tree - {KVStoreError} == set(STATUS_TABLE)
    assert STATUS_TABLE == EXPECTED


@pytest.mark.parametrize("cls,code", list(EXPECTED.items()), ids=lambda x: getattr(x, "__name__", str(x)))
def test_exception_to_code_and_back(cls: type[KVStoreError], code: grpc.StatusCode) -> None:
    assert status_for(cls("x")) is code
    assert ERROR_FOR_CODE[code] is cls
    back = error_for(code, "what happened")
    assert type(back) is cls
    assert str(back) == f"{code.name}: what happened"
    assert code_from_value(code.value[0]) is code


def test_a_subclass_maps_like_its_parent() -> None:
    class Mine(errors.NotFound):
        pass

    assert status_for(Mine("gone")) is grpc.StatusCode.NOT_FOUND


def test_outside_the_tree() -> None:
    assert status_for(ValueError("bug")) is grpc.StatusCode.INTERNAL
    assert status_for(KVStoreError("base")) is grpc.StatusCode.INTERNAL
    # codes the table does not name come back as Unavailable (retry elsewhere)
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED):
        e = error_for(code, "x")
        assert type(e) is errors.Unavailable and str(e) == f"{code.name}: x"
    assert type(error_for(None, "x")) is errors.Unavailable and str(error_for(None, "x")) == "ERROR: x"
    assert code_from_value(250) is grpc.StatusCode.UNKNOWN


def test_error_from_rpc() -> None:
    class FakeRpcError(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.DATA_LOSS

        def details(self) -> str:
            return "checksum"

    e = error_from_rpc(FakeRpcError())
    assert isinstance(e, errors.DataLoss) and str(e) == "DATA_LOSS: checksum"
