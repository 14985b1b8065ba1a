"""Error feedback on DiLoCo's pseudo-gradients (cgx_ucx.torchft.PseudoGradientFeedback),
on stand-ins of a DiLoCo fragment and its Manager (no processes): what each sync sends,
the residual it leaves, rollback of uncommitted syncs, healing groups, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torchft")

from cgx_ucx.compression import decode, encode
from cgx_ucx.config import CompressionConfig
from cgx_ucx.errors import ConfigError
from cgx_ucx.torchft import ProcessGroupCGX, PseudoGradientFeedback

NUMEL = 5000  # compressed: above the minimal size; "b" (10 values) stays exact


class Manager:
    participating = True

    def is_participating(self) -> bool:
        return self.participating


class Fragment:
    """torchft 0.2's _StreamingDiLoCoFragment as far as the feedback sees it."""

    use_bucketization = False

    def __init__(self) -> None:
        self._manager = Manager()
        self._grads: dict[str, torch.Tensor] = {}
        self.next: dict[str, torch.Tensor] = {}
        self.commit = True

    def _save_grads(self) -> None:
        self._grads = {name: t.clone() for name, t in self.next.items()}

    def prepare_sync(self) -> None:
        self._save_grads()

    def perform_sync(self) -> bool:
        return self.commit


class DiLoCo:
    def __init__(self, *fragments: Fragment) -> None:
        self._fragments = list(fragments)


def quantized(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What the all-reduce delivers of this replica's ``x``: round to nearest, in buckets
    of CompressionConfig's default size."""
    bucket = CompressionConfig(bits=bits).bucket_size
    return torch.from_numpy(decode(encode(x.numpy(), bits, bucket)).copy())


def sync(fragment: Fragment, rng: np.random.Generator) -> tuple[dict, dict]:
    fragment.next = {
        "w": torch.from_numpy(rng.standard_normal(NUMEL).astype(np.float32)),
        "b": torch.from_numpy(rng.standard_normal(10).astype(np.float32)),
    }
    fragment.prepare_sync()
    sent = {k: v.clone() for k, v in fragment._grads.items()}
    fragment.perform_sync()
    return fragment.next, sent


def test_each_sync_sends_its_pseudo_gradient_plus_the_last_residual():
    rng = np.random.default_rng(0)
    fragment = Fragment()
    pg = ProcessGroupCGX(bits=2)
    feedback = PseudoGradientFeedback(DiLoCo(fragment), pg)
    g, sent = sync(fragment, rng)
    assert torch.equal(sent["w"], g["w"]) and torch.equal(sent["b"], g["b"])  # no residual yet
    residual = sent["w"] - quantized(sent["w"], 2)
    assert residual.abs().max() > 0
    g, sent = sync(fragment, rng)
    assert torch.equal(sent["w"], g["w"] + residual)
    assert torch.equal(sent["b"], g["b"])  # an exact layer has no residual
    # A sync that is not committed puts the residual back: the next one adds it again.
    residual = sent["w"] - quantized(sent["w"], 2)
    fragment.commit = False
    g, sent = sync(fragment, rng)
    assert torch.equal(sent["w"], g["w"] + residual)
    fragment.commit = True
    g, sent = sync(fragment, rng)
    assert torch.equal(sent["w"], g["w"] + residual)
    assert (feedback.applied, feedback.rolled_back) == (4, 1)
    # A healing group (not participating) sends nothing of its own: residuals stay.
    residual = sent["w"] - quantized(sent["w"], 2)
    fragment._manager.participating = False
    g, sent = sync(fragment, rng)
    assert torch.equal(sent["w"], g["w"])
    fragment._manager.participating = True
    g, sent = sync(fragment, rng)
    assert torch.equal(sent["w"], g["w"] + residual)
    # A sync sent exactly flushes the residual once.
    residual = sent["w"] - quantized(sent["w"], 2)
    with pg.compressed(bits=32):
        assert pg.effective_compression() is None
        g, sent = sync(fragment, rng)
    assert torch.equal(sent["w"], g["w"] + residual)
    g, sent = sync(fragment, rng)
    assert torch.equal(sent["w"], g["w"])


@pytest.mark.parametrize("bits", [2, 4])
def test_what_arrives_over_many_syncs_stays_within_one_residual_of_what_was_meant(bits):
    """EF's point: the sum of the delivered (quantized) pseudo-gradients differs from the
    sum of the true ones by the last residual only, where without feedback the errors
    add up."""
    rng = np.random.default_rng(1)
    fragment = Fragment()
    pg = ProcessGroupCGX(bits=bits)
    PseudoGradientFeedback(DiLoCo(fragment), pg)
    meant = torch.zeros(NUMEL)
    delivered = torch.zeros(NUMEL)
    plain = torch.zeros(NUMEL)
    for _ in range(40):
        g, sent = sync(fragment, rng)
        meant += g["w"]
        delivered += quantized(sent["w"], bits)
        plain += quantized(g["w"], bits)
    one_step = (g["w"] - quantized(g["w"], bits)).abs().max()
    ef_error = (delivered - meant).abs().max()
    plain_error = (plain - meant).abs().max()
    assert ef_error <= 2 * one_step
    assert plain_error > 2 * ef_error


def test_refusals():
    pg = ProcessGroupCGX(bits=2)
    with pytest.raises(ConfigError, match="DiLoCo"):
        PseudoGradientFeedback(object(), pg)
    fragment = Fragment()
    fragment.use_bucketization = True
    with pytest.raises(ConfigError, match="use_bucketization=False"):
        PseudoGradientFeedback(DiLoCo(fragment), pg)
    with pytest.raises(ConfigError, match="ProcessGroupCGX"):
        PseudoGradientFeedback(DiLoCo(Fragment()), object())


def test_two_fragments_keep_residuals_of_their_own():
    rng = np.random.default_rng(2)
    a, b = Fragment(), Fragment()
    PseudoGradientFeedback(DiLoCo(a, b), ProcessGroupCGX(bits=2))
    _, sent_a = sync(a, rng)
    sync(b, rng)  # the same parameter names and shapes as a's
    residual_a = sent_a["w"] - quantized(sent_a["w"], 2)
    g, sent = sync(a, rng)
    assert torch.equal(sent["w"], g["w"] + residual_a)
