"""`agreed_exit`: rank-0-only work (a scikit-learn fit, a stage's writes) that fails stops every
rank at the block's end, rank 0 with its own error and the others with PeerFailed, instead of
the others waiting at their next collective for a rank that is gone (2 gloo ranks)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import torch.distributed as dist

from moe_train.errors import PeerFailed
from moe_train.parallel.collectives import agreed_exit, broadcast_object
from tests.distributed.two_ranks import init_ep2, spawn_two


def _worker(rank: int, port: int, out: str) -> None:
    rt = init_ep2(rank, port)
    seen = []
    # nobody fails: both leave together and go on to the next collective
    with agreed_exit(rt, "peer"):
        value = 7 if rt.is_main else None
    seen.append(("ok", broadcast_object(rt, value)))
    # rank 0's write fails: it raises its own error, rank 1 PeerFailed with the message
    for failing in (0, 1):
        try:
            with agreed_exit(rt, f"rank {failing} failed"):
                if rank == failing:
                    raise OSError(errno.ENOSPC, "No space left on device", "/x/labels.npy")
            seen.append(("none", None))
        except PeerFailed as exc:
            seen.append(("peer", str(exc)))
        except OSError as exc:
            seen.append(("own", exc.filename))
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def test_a_failure_on_one_rank_stops_both_at_the_block_end(tmp_path):
    spawn_two(_worker, str(tmp_path), 120, "agreed_exit")
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0 == [["ok", 7], ["own", "/x/labels.npy"], ["peer", "rank 1 failed"]]
    assert rank1 == [["ok", 7], ["peer", "rank 0 failed"], ["own", "/x/labels.npy"]]
