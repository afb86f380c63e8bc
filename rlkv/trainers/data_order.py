"""Data order that survives a resume: each epoch's prompt permutation depends on (seed, epoch) only.

TRL's `RepeatSampler` draws a fresh permutation from one generator, seeded once, on every pass, so
epoch e of a run sees the (e+1)-th draw. A run resumed in epoch e builds a new sampler and draws
the first permutation again: it trains on epoch 0's order, not the one the interrupted run would
have used, and its rollouts (hence gates) diverge from an uninterrupted run. transformers calls
`set_epoch(epoch)` on the sampler before every epoch, resumed or not; reseeding there makes the
permutation a function of the epoch. Epoch 0 keeps the seed itself, so its order is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler

from rlkv.compat import PrivateAPI, check_attributes

# the RepeatSampler fields this reads (trl.trainer.utils; private); it has a generator only when it shuffles
REPEAT_SAMPLER_API = PrivateAPI(attributes=("shuffle", "seed"))
SHUFFLING_SAMPLER_API = PrivateAPI(attributes=("generator",))


class EpochSeededSampler(Sampler):
    """Wraps a TRL `RepeatSampler`; `set_epoch(e)` reseeds its generator with `seed + e` when it shuffles."""

    def __init__(self, sampler: Sampler):
        feature = "GateGRPOTrainer's resumable data order"
        check_attributes(sampler, REPEAT_SAMPLER_API, feature=feature)
        if sampler.shuffle:
            check_attributes(sampler, SHUFFLING_SAMPLER_API, feature=feature)
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        if self.sampler.shuffle:
            self.sampler.generator.manual_seed(self.sampler.seed + epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)
