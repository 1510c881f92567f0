"""The bookkeeping of batched greedy and beam search, shared by the encoder-decoder and the
decoder-only searches (eval/search.py, eval/lm_search.py), which own the model calls and move
their own per-row state (cache, encoder output, mask, context) by the indices returned here.

`GreedyBook`: the argmax token of every live row; finished rows feed pad until they leave.
`BeamBook`, fairseq's rule: each step takes the top 2K of the K x V extensions of each live sentence. Eos
extensions ranked in the top K become finished hypotheses (scored sum(log p) / len**lenpen, len
counting eos); the K best non-eos extensions stay live. A sentence is done once it has K
finished hypotheses or reaches its length limit; done sentences leave the batch (the searches
run beam 1 as greedy search). `BeamBook` keeps the scores, tokens and finished hypotheses; the caller owns the model
call and moves its own per-row state (cache, encoder output, mask, context) by the indices
`select` returns.

Shape legend: L live sentences, K beam, N = L * K rows, V vocabulary, C candidates (2K),
F hypotheses finished in one step, T tokens so far.
"""

from __future__ import annotations

import torch
from torch import Tensor


def strip_eos(tokens: list[int], eos_id: int) -> list[int]:
    """Tokens up to (not including) the first eos."""
    return tokens[:tokens.index(eos_id)] if eos_id in tokens else tokens


class GreedyBook:
    """Tokens and finished sentences of a greedy search over B sentences (A live rows)."""

    def __init__(self, B: int, max_len_B: Tensor, min_len_B: Tensor | None, eos_id: int,
                 pad_id: int, device: torch.device) -> None:
        self.eos_id, self.pad_id = eos_id, pad_id
        self.sentence_A = torch.arange(B, device=device)  # the sentence of each live row
        self.max_len_A, self.min_len_A = max_len_B, min_len_B
        self.finished_A = torch.zeros(B, dtype=torch.bool, device=device)
        self.tokens_AT = torch.empty((B, 0), dtype=torch.long, device=device)
        self._results: list[list[int] | None] = [None] * B

    def advance(self, scores_AV: Tensor) -> tuple[Tensor, bool]:
        """(next token of every row: its argmax, pad once finished; whether all rows are
        finished: one host sync). The length limit forces eos, so the search ends."""
        next_A = scores_AV.argmax(dim=-1)
        next_A = torch.where(self.finished_A, torch.full_like(next_A, self.pad_id), next_A)
        self.tokens_AT = torch.cat([self.tokens_AT, next_A[:, None]], dim=1)
        self.finished_A |= next_A.eq(self.eos_id)
        self.num_done = int(self.finished_A.sum())
        return next_A, self.num_done == self.finished_A.numel()

    def prune(self) -> Tensor | None:
        """Drop finished rows (their tokens kept): the rows that stay, or None when no row
        finished since the last call or all have."""
        if not 0 < self.num_done < self.finished_A.numel():
            return None
        done_R = self.finished_A.nonzero().flatten()
        for row, tokens in zip(self.sentence_A[done_R].tolist(),
                               self.tokens_AT.index_select(0, done_R).tolist()):
            self._results[row] = tokens
        keep_R = (~self.finished_A).nonzero().flatten()
        self.sentence_A, self.tokens_AT, self.max_len_A, self.finished_A = (
            t.index_select(0, keep_R) for t in (self.sentence_A, self.tokens_AT,
                                                self.max_len_A, self.finished_A))
        if self.min_len_A is not None:
            self.min_len_A = self.min_len_A.index_select(0, keep_R)
        self.num_done = 0
        return keep_R

    def results(self) -> list[list[int]]:
        """Each sentence's tokens without eos."""
        for row, tokens in zip(self.sentence_A.tolist(), self.tokens_AT.tolist()):
            self._results[row] = tokens
        return [strip_eos(tokens, self.eos_id) for tokens in self._results]


class BeamBook:
    """Scores, tokens and finished hypotheses of B sentences x K beams during a search."""

    def __init__(self, B: int, K: int, max_len_B: Tensor, min_len_B: Tensor | None, eos_id: int,
                 lenpen: float, device: torch.device) -> None:
        self.K, self.eos_id, self.lenpen, self.device = K, eos_id, lenpen, device
        self.B = B
        self.sentence_L = list(range(B))  # the sentence of each live sentence slot
        self.max_len_L, self.min_len_L = max_len_B, min_len_B
        # Only beam 0 is live at the start; the others are -inf so they never win a slot.
        self.scores_LK = torch.full((B, K), -torch.inf, device=device)
        self.scores_LK[:, 0] = 0.0
        self.tokens_NT = torch.empty((B * K, 0), dtype=torch.long, device=device)
        self.finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
        self.n_finished_L = torch.zeros(B, dtype=torch.long, device=device)
        """len(finished[s]) of each live sentence s, kept on the device."""
        self.done_L = torch.zeros(B, dtype=torch.bool, device=device)
        self._step: tuple[Tensor, ...] | None = None

    def limits_N(self) -> tuple[Tensor, Tensor | None]:
        """(max_len_N, min_len_N) of every live row, for the logit bans."""
        K = self.K
        return (self.max_len_L.repeat_interleave(K),
                None if self.min_len_L is None else self.min_len_L.repeat_interleave(K))

    def advance(self, lprobs_NV: Tensor, step: int) -> bool:
        """Score this step's extensions, record finished hypotheses; whether every live
        sentence is now done. One host sync (the number finished this step and of sentences
        done, read together), and one copy of the hypotheses on steps where some finish."""
        L, K = len(self.sentence_L), self.K
        V = lprobs_NV.size(-1)
        cand_LX = (self.scores_LK[:, :, None] + lprobs_NV.view(L, K, V)).view(L, K * V)
        top_scores_LC, top_idx_LC = cand_LX.topk(min(2 * K, K * V), dim=1)
        top_beam_LC = top_idx_LC // V
        top_tok_LC = top_idx_LC % V
        is_eos_LC = top_tok_LC.eq(self.eos_id)

        final_LK = is_eos_LC[:, :K] & top_scores_LC[:, :K].isfinite() & ~self.done_L[:, None]
        self.n_finished_L += final_LK.sum(1)
        self.done_L |= self.n_finished_L.ge(K) | self.max_len_L.le(step + 1)
        self._step = (top_scores_LC, top_beam_LC, top_tok_LC, is_eos_LC)
        n_final, self.num_done = torch.stack([final_LK.sum(), self.done_L.sum()]).tolist()
        if n_final:  # one host transfer for all of them: (score, sentence slot, tokens) rows
            flat_F = (~final_LK).reshape(-1).to(torch.uint8).argsort(stable=True)[:n_final]
            b_F, c_F = flat_F // K, flat_F % K  # row-major, as nonzero orders them
            tokens_FT = self.tokens_NT.index_select(0, b_F * K + top_beam_LC[b_F, c_F])
            score_F = top_scores_LC[b_F, c_F].double() / (step + 1) ** self.lenpen
            rows_F = torch.cat([score_F[:, None], b_F[:, None].double(), tokens_FT.double()], 1)
            for score, b, *hyp in rows_F.tolist():  # token ids are exact in float64
                self.finished[self.sentence_L[int(b)]].append((score, [int(t) for t in hyp]))
        return self.num_done == L

    def select(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keep the K best non-eos extensions per sentence and drop done sentences.

        Returns (reorder_N, next_N, rows_R): row i of the next step continues old row
        reorder_N[i] with token next_N[i]; rows_R (None when no sentence left) are the old rows
        of the sentences still live, for per-sentence state that need not follow the beams.
        """
        top_scores_LC, top_beam_LC, top_tok_LC, is_eos_LC = self._step
        L, K, dev = len(self.sentence_L), self.K, self.device
        # Live: the first K non-eos candidates, in score order (there are at most K eos ones).
        C = top_scores_LC.size(1)
        rank_LC = torch.arange(C, device=dev)[None] + is_eos_LC.long() * C
        live_LK = rank_LC.topk(K, dim=1, largest=False).indices
        self.scores_LK = top_scores_LC.gather(1, live_LK)
        reorder_LK = torch.arange(L, device=dev)[:, None] * K + top_beam_LC.gather(1, live_LK)
        next_LK = top_tok_LC.gather(1, live_LK)
        rows_R = None
        if 0 < self.num_done < L:  # done sentences leave the batch
            keep_S = (~self.done_L).nonzero().flatten()
            for b in self.done_L.nonzero().flatten().tolist():
                if not self.finished[self.sentence_L[b]]:  # unreachable with a finite model
                    self.finished[self.sentence_L[b]].append((-torch.inf, strip_eos(
                        self.tokens_NT[b * K].tolist(), self.eos_id)))
            self.sentence_L = [self.sentence_L[b] for b in keep_S.tolist()]
            reorder_LK, next_LK, self.scores_LK, self.max_len_L, self.done_L, \
                self.n_finished_L = (t.index_select(0, keep_S) for t in (
                    reorder_LK, next_LK, self.scores_LK, self.max_len_L, self.done_L,
                    self.n_finished_L))
            if self.min_len_L is not None:
                self.min_len_L = self.min_len_L.index_select(0, keep_S)
            rows_R = (keep_S[:, None] * K + torch.arange(K, device=dev)[None]).view(-1)
        reorder_N, next_N = reorder_LK.view(-1), next_LK.view(-1)
        self.tokens_NT = torch.cat([self.tokens_NT.index_select(0, reorder_N), next_N[:, None]],
                                   dim=1)
        return reorder_N, next_N, rows_R

    def results(self) -> list[list[int]]:
        """Each sentence's best finished hypothesis (tokens without eos)."""
        out = []
        for b in range(self.B):
            if self.finished[b]:
                out.append(max(self.finished[b], key=lambda item: item[0])[1])
            else:  # unreachable with a finite model: the limit forces eos on every live beam
                out.append(strip_eos(self.tokens_NT[self.sentence_L.index(b) * self.K].tolist(),
                                     self.eos_id))
        return out
