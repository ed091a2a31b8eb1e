"""The kvstore client: sync and asyncio clients with the same methods."""

from kvstore.client.sync import AsyncClient, Client, Lease, Reservation, ns_pb

__all__ = ["AsyncClient", "Client", "Lease", "Reservation", "ns_pb"]
