"""Which real MoE shapes DeepEP's normal kernels take (steps/expert_parallel/deepep.py check_deepep_shape), held to
DeepEP dd758ca (the trainer image's DEEPEP_COMMIT), and that make_dispatch checks before it builds a
DeepEPDispatch. The limits, each a static/host assert there:
  hidden % 256 == 0       deep_ep/include/deep_ep/impls/combine.cuh:109 (hybrid_combine.cuh:219)
  1 <= top_k <= 32        deep_ep/include/deep_ep/impls/dispatch.cuh:93; combine_utils.cuh:71
  experts % ep == 0       csrc/elastic/buffer.hpp:805 (common/layout.cuh:37, impls/dispatch.cuh:47)
  experts / ep <= 256     deep_ep/include/deep_ep/common/layout.cuh:40
  experts <= 2048         deep_ep/include/deep_ep/common/layout.cuh:39
  ep <= 1024              deep_ep/include/deep_ep/common/layout.cuh:38
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from steps.errors import MoerlError
from steps.expert_parallel import dispatch as dispatch_module
from steps.expert_parallel.deepep import check_deepep_shape

# name: (hidden_size, num_experts, top_k), from each model's config.json
FAMILIES = {
    "DeepSeek-V3": (7168, 256, 8),  # 7168 = 28 x 256
    "Kimi-K2": (7168, 384, 8),
    "GLM-4.5": (5120, 160, 8),  # 20 x 256
    "Qwen3-235B-A22B": (4096, 128, 8),
    "Qwen3-30B-A3B": (2048, 128, 8),
    "Mixtral-8x7B": (4096, 8, 2),
    "Qwen2-57B-A14B": (3584, 64, 8),  # 14 x 256
    "gpt-oss-120b": (2880, 128, 4),  # 2880 = 11 x 256 + 64: refused
}


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "gpt-oss-120b"])
def test_these_families_fit_deepep_on_one_node_of_eight(name):
    check_deepep_shape(*FAMILIES[name], ep_size=8)


def test_gpt_oss_hidden_2880_does_not_fit_deepeps_combine():
    with pytest.raises(MoerlError, match=r"hidden_size 2880 is not a multiple of 256.*combine\.cuh:109") as err:
        check_deepep_shape(*FAMILIES["gpt-oss-120b"], ep_size=8)
    assert "trainer.ep_backend: alltoall" in str(err.value)


@pytest.mark.parametrize(
    "name, ep_size, fits",
    [
        ("DeepSeek-V3", 64, True),  # 4 experts a rank
        ("DeepSeek-V3", 256, True),  # 1 a rank
        ("Kimi-K2", 16, True),  # 24 a rank
        ("Kimi-K2", 256, False),  # 384 % 256
        ("GLM-4.5", 32, True),  # 5 a rank
        ("GLM-4.5", 64, False),  # 160 % 64
        ("Qwen3-235B-A22B", 16, True),
        ("Mixtral-8x7B", 8, True),  # one expert a rank
        ("Mixtral-8x7B", 16, False),  # more ranks than experts
        ("Qwen2-57B-A14B", 16, True),  # 4 a rank
        ("Qwen2-57B-A14B", 128, False),  # more ranks than experts
    ],
)
def test_expert_counts_must_split_evenly_over_the_ep_group(name, ep_size, fits):
    hidden, experts, top_k = FAMILIES[name]
    if fits:
        check_deepep_shape(hidden, experts, top_k, ep_size)
    else:
        with pytest.raises(MoerlError, match=r"do not split evenly over ep_size .*buffer\.hpp:805"):
            check_deepep_shape(hidden, experts, top_k, ep_size)


def test_the_other_limits_name_their_source():
    with pytest.raises(MoerlError, match=r"top_k 33 is outside 1\.\.32.*dispatch\.cuh:93"):
        check_deepep_shape(4096, 128, 33, 8)
    with pytest.raises(MoerlError, match=r"top_k 0 is outside"):
        check_deepep_shape(4096, 128, 0, 8)
    with pytest.raises(MoerlError, match=r"384 experts a rank exceed DeepEP's 256.*layout\.cuh:40"):
        check_deepep_shape(7168, 384, 8, 1)
    with pytest.raises(MoerlError, match=r"4096 experts exceed DeepEP's 2048.*layout\.cuh:39"):
        check_deepep_shape(4096, 4096, 8, 64)
    with pytest.raises(MoerlError, match=r"ep_size 2048 is outside 1\.\.1024"):
        check_deepep_shape(4096, 2048, 8, 2048)
    with pytest.raises(MoerlError, match=r"hidden_size 0"):
        check_deepep_shape(0, 128, 8, 8)


def test_every_problem_is_named_in_one_error():
    with pytest.raises(MoerlError) as err:
        check_deepep_shape(2880, 8, 40, 16)
    text = str(err.value)
    assert "hidden_size 2880" in text and "top_k 40" in text and "ep_size 16" in text
    assert text.count("trainer.ep_backend: alltoall") == 1


def test_make_dispatch_checks_the_shape_before_it_builds_deepep(monkeypatch):
    """The check sits where make_dispatch builds DeepEPDispatch: a CUDA mesh with gpt-oss's shape is refused
    before DeepEP is imported or its buffer made."""
    built = []
    monkeypatch.setattr(dispatch_module, "DeepEPDispatch", lambda *args: built.append(args) or "deepep")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("EP_DISABLE_GIN", "1")  # make_dispatch sets it for a group inside a node; restored after
    mesh = SimpleNamespace(ep_size=8, ep_group=object(), device=torch.device("cuda", 0), world_size=8)
    with pytest.raises(MoerlError, match="hidden_size 2880"):
        dispatch_module.make_dispatch("deepep", mesh, 128, 2880, 4, 64)
    assert built == []
    assert dispatch_module.make_dispatch("deepep", mesh, 256, 7168, 8, 64) == "deepep"
    assert built[0][1:3] == (256, 32)  # all experts, 32 a rank
