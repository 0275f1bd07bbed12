"""trainer.router: 'freeze' (the default, as NeMo-RL's MoE GRPO recipes) keeps every router weight at its SFT
value through an update (no gradient, no AdamW state) while the rest of the policy moves; 'train' moves them."""

from __future__ import annotations

import os

import pytest
import torch
from test_update_experience import experience_table, make_run, run_cmd, torchrun_update, write_experience

from steps.models.hf_checkpoint import load_pretrained, load_state_dict_from_dir
from steps.publish import publish
from steps.run.config import validate_config
from steps.store.object_store import Store

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_the_router_setting_defaults_to_freeze_and_names_its_choices():
    base = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}
    assert validate_config(base).trainer.router == "freeze"
    assert validate_config({**base, "trainer": {"router": "train"}}).trainer.router == "train"
    with pytest.raises(Exception, match="router"):
        validate_config({**base, "trainer": {"router": "thaw"}})


@pytest.mark.parametrize("router", ["freeze", "train"])
def test_an_update_keeps_or_moves_the_routers(tmp_path, router):
    run_uri = make_run(tmp_path, trainer={"router": router})
    write_experience(run_uri, 1, experience_table(policy_version=0, prompts=4, group=4))
    done = run_cmd(torchrun_update(run_uri, 1, 2))
    assert done.returncode == 0, done.stderr[-3000:]
    publish(run_uri, 1)
    before = load_state_dict_from_dir(tmp_path / "sft")
    after_dir = tmp_path / "v1"
    Store.open(run_uri).download_dir("checkpoints/v000001", after_dir)
    after = load_state_dict_from_dir(after_dir)
    routers = [name for name in before if name.endswith("mlp.gate.weight")]
    assert routers
    moved = [name for name in routers if not torch.equal(before[name], after[name])]
    others = [name for name in before if name not in routers and not torch.equal(before[name], after[name])]
    assert others  # the policy itself moved
    assert moved == ([] if router == "freeze" else routers)
    load_pretrained(after_dir)  # a checkpoint moerl loads
