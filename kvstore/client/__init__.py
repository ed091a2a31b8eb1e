"""The kvstore client: sync and asyncio clients with the same methods and
typed results (``kvstore.results``)."""

from kvstore.client.aio import AsyncClient
from kvstore.client.sync import Client, Lease, PendingReservation, Reservation
from kvstore.wire.convert import ns_pb

__all__ = ["AsyncClient", "Client", "Lease", "PendingReservation", "Reservation", "ns_pb"]
