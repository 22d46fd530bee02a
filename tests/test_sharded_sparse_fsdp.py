"""An FSDP2 learner over 2 ranks with sparse deltas (TOPK_F8 at 2 values a chunk, error
feedback), in real processes (torchrun, gloo on CPU) on a local-directory mailbox: each
rank sparsifies its own rows and keeps its own residual; the run equals the sparse
oracle (tests/test_sharded_sparse.py), the parts on the wire are the oracle's rows
exactly, each rank's residual is the oracle's at its rows, and the learner's gathered
error feedback (its checkpoint state) is the oracle's whole: what it sent plus what it
kept is what it trained. `gradientmail verify` re-derives every round from the parts.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_learner_oracle import ROUNDS
from test_sharded_oracle import ranked
from test_sharded_sparse import sparse_oracle
from test_verify import statuses, verify
from workers.toy import make_model

from gradientmail.adapters.sharded import chunk_rows
from gradientmail.mailbox import LocalMailbox
from gradientmail.run.protocol import Exchange
from gradientmail.wire import compression as codec
from gradientmail.wire.sharded_parts import rows_in
from gradientmail.wire.sparse import CHUNK, densify, sparse_nbytes

pytestmark = pytest.mark.slow

DENSITY = 2 / CHUNK


def last_parts(box: Path) -> tuple[Any, list[Any]]:
    """The last round's contribution record and its parts, decoded (kept: `keep_rounds`)."""
    async def read() -> tuple[Any, list[Any]]:
        ex = Exchange(LocalMailbox(box))
        snap = await ex.contribution(ROUNDS - 1, "fsdp")
        assert snap is not None
        parts = []
        for ref in snap.parts:
            blob = await ex.store.fetch_payload(ref, 1 << 20)
            assert blob is not None and len(blob) == ref.size
            entries, meta = codec.decode_with_metadata(blob, codec.compression_of(ref.key),
                                                      key=ref.key, max_bytes=1 << 20)
            parts.append((ref, entries, rows_in(meta, ref.key)))
        return snap, parts

    return asyncio.run(read())


def test_an_fsdp2_learner_mailing_sparse_parts_equals_the_sparse_oracle(tmp_path: Path) -> None:
    box = tmp_path / "run"
    out = tmp_path / "fsdp.json"
    proc = ranked(box, "fsdp", 0, out, "--fsdp", "--learners", "1", "--checkpoint-every", "1",
                  "--delta-dtype", "TOPK_F8", "--density", str(DENSITY),
                  "--keep-rounds", str(ROUNDS))
    try:
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, log.decode()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    want, residual, last = sparse_oracle((("fsdp", 0, 2),), DENSITY)
    got = [json.loads(out.read_text()), json.loads(Path(f"{out}.rank1").read_text())]
    model = make_model()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for k, result in enumerate(got):
        assert result["rounds_seen"] == ROUNDS - 1, k
        for (name, shape), w in zip(shapes.items(), want, strict=True):
            g = torch.tensor(result["params"][name]).reshape(shape)
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"rank {k}: {name}")
        # Each rank keeps the residual of its own rows: the oracle's there.
        fb = result["feedback"]
        for name, shape in shapes.items():
            a, b = chunk_rows(shape[0], 2, k)
            width = shape.numel() // shape[0]
            assert fb["spans"][name] == [a * width, b * width]
            np.testing.assert_allclose(np.array(fb["own"][name], np.float32),
                                       residual["fsdp"][name][a * width:b * width],
                                       rtol=0, atol=1e-6, err_msg=f"rank {k}: {name}")
    # The checkpoint state rank 0 gathers: whole tensors, nothing in flight.
    gathered = got[0]["feedback"]["gathered"]
    assert gathered["in_flight"] == []
    for name in shapes:
        np.testing.assert_allclose(np.array(gathered["residuals"][name], np.float32),
                                   residual["fsdp"][name], rtol=0, atol=1e-6, err_msg=name)
    # On the wire: one part per rank, each its rows in TOPK_F8 at 2 values a chunk, of
    # exactly the bytes the format gives them, carrying the oracle's last step.
    snap, parts = last_parts(box)
    assert snap.delta_format == "TOPK_F8" and snap.payload is None and len(parts) == 2
    assert snap.payload_size == sum(ref.size for ref, _, _ in parts)
    for k, (ref, entries, rows) in enumerate(parts):
        assert ref.key.endswith(f"/{k}-of-2.safetensors")
        data = 0
        for name, shape in shapes.items():
            a, b = rows[name]
            assert (a, b) == chunk_rows(shape[0], 2, k)
            width = shape.numel() // shape[0]
            dense = densify(entries, name, (b - a, *shape[1:]), "TOPK_F8").to_numpy()
            np.testing.assert_allclose(dense.reshape(-1),
                                       last["fsdp"][name][a * width:b * width],
                                       rtol=0, atol=1e-6, err_msg=f"part {k}: {name}")
            assert np.count_nonzero(dense) <= min(2, (b - a) * width)
            data += sparse_nbytes((b - a) * width, DENSITY)
        assert sum(t.nbytes for t in entries.values()) == data
    # `gradientmail verify` re-derives every round from the kept sparse parts.
    report = verify(LocalMailbox(box))
    assert report.ok and statuses(report) == ["verified"] * ROUNDS
