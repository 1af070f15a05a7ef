"""KV transfer test helpers: the header a prefill replica sends before an export's chunks."""

from __future__ import annotations

from services.engine.kv_export import KVExport
from services.kvtransfer.chunks import TARGET_CHUNK_BYTES, Layout, num_chunks
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb


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
