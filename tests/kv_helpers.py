"""KV test helpers: the header a prefill replica sends before an export's chunks; a Redis of the shared
tier's role on a free port."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.common.cache_redis import start_cache_redis, stop_cache_redis
from services.engine.kv_export import KVExport
from services.kvtransfer.chunks import TARGET_CHUNK_BYTES, Layout, num_chunks
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from tests.ports import free_port


def prefill_header(
    export: KVExport, layout: Layout, chunk_bytes: int = TARGET_CHUNK_BYTES
) -> kvpb.PrefillHeader:
    """The header of `export` cut into chunks of about `chunk_bytes`."""
    num_kv = export.kv.shape[1]
    return kvpb.PrefillHeader(
        layout=layout.to_proto(),
        first_token_position=export.start_token,
        num_kv_tokens=num_kv,
        num_chunks=num_chunks(export.start_token, num_kv, layout, chunk_bytes),
    )


@contextmanager
def cache_redis_url(maxmemory_mb: int) -> Iterator[str]:
    """A Redis of the shared tier's role (LRU over `maxmemory_mb`, persistence off) on a free port, for
    the block: its URL."""
    port = free_port()
    proc = start_cache_redis(port, maxmemory_mb=maxmemory_mb)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_cache_redis(proc)
