"""Views of a prepared split that tell a model other things about its sentences."""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_train.data.shards import MANIFEST, ShardedDataset
from moe_train.errors import DataError


class Relabeled:
    """A dataset view with other domain ids: RND (labels withheld / randomised) or TAG_CLF (a
    classifier's predicted domains).

    When the data has domain tags (manifest ``domain_tags``), `src(i)` gives the source with its
    leading ``<dom:NAME>`` replaced by the tag of ``domain_ids[i]``; lengths are unchanged.
    Everything else is the dataset's.
    """

    def __init__(self, dataset: ShardedDataset, domain_ids_N: np.ndarray) -> None:
        domain_ids_N = np.asarray(domain_ids_N, dtype=np.int64)
        if domain_ids_N.shape != (len(dataset),):
            raise ValueError(f"domain_ids_N: expected shape ({len(dataset)},), "
                             f"got {domain_ids_N.shape}")
        self._dataset = dataset
        self.domain_ids = domain_ids_N
        self._tag_ids_D: np.ndarray | None = None
        manifest = dataset.manifest
        if manifest.get("domain_tags"):
            tags = {int(c["domain_id"]): int(c["domain_tag_id"]) for c in manifest["corpora"]}
            self._tag_ids_D = np.asarray([tags[d] for d in range(len(manifest["domains"]))],
                                         dtype=np.int64)
            if np.any((domain_ids_N < 0) | (domain_ids_N >= len(self._tag_ids_D))):
                raise ValueError(f"domain_ids_N: expected ids in 0..{len(self._tag_ids_D) - 1}")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_dataset":  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self._dataset, name)

    def __len__(self) -> int:
        return len(self._dataset)

    def src(self, i: int) -> np.ndarray:
        """Source token ids of sentence i, its domain tag (if any) that of ``domain_ids[i]``."""
        src_S = self._dataset.src(i)
        if self._tag_ids_D is None:
            return src_S
        if not len(src_S) or src_S[0] not in self._tag_ids_D:
            raise DataError(f"{self._dataset.prepared_dir}/{self._dataset.split}: sentence {i} "
                            f"does not start with a domain tag, though {MANIFEST} has "
                            "domain_tags; run `moe-train prepare` again")
        return np.concatenate([[self._tag_ids_D[self.domain_ids[int(i)]]], src_S[1:]])
