"""LoRA (`megarl.models.lora`, `megarl.convert.peft`) against PEFT on transformers: the same
logits and adapter gradients at 1 rank, DP2, TP2 + SP, PP2 and PP2 x VPP2 (fp32, <= 1e-5), and
of a Mixtral with attention adapters at 1 rank and EP2; the same merged weights, the base with
the adapters off, only adapters in the optimizer, a PEFT directory that `peft` loads with the
same logits, a checkpoint written at TP2 + SP that resumes at PP2, and the config errors. Two
process launches in all (one rank, then two)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from megarl.config import load_config
from megarl.distributed.launch import spawn
from megarl.errors import ConfigError
from megarl.models.hf_config import arch_from_hf
from megarl.models.lora import LoraConfig, check_lora
from tests import lora_worker as lw
from tests.tiny import TINY_LLAMA, TINY_MIXTRAL

R, ALPHA = 4, 8.0
TOL = 1e-5


def token_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, TINY_LLAMA["vocab_size"], (4, 12), generator=g)
    return {"tokens": tok, "targets": torch.roll(tok, -1, 1), "mask": torch.ones(4, 12)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lora"))
    ref, one, moe_ref, moe_one, scalar = spawn(
        lw.single_rank, 1, TINY_LLAMA, out, token_batch(), R, ALPHA, TINY_MIXTRAL
    )[0]
    one["scalar"] = scalar
    two = spawn(lw.two_ranks, 2, TINY_LLAMA, out, token_batch(), R, ALPHA, TINY_MIXTRAL)
    return out, ref, one, two, (moe_ref, moe_one)


def _stack(results: list[dict], key: str) -> torch.Tensor:
    rows = {}
    for r in results:
        rows.update(r[key])
    return torch.stack([rows[i] for i in range(len(rows))])


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:4]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _layouts(runs):
    _, _, one, two, _ = runs
    yield "1 rank", [one]
    for name in ("dp2", "tp2-sp", "pp2", "pp2-vpp2"):
        yield name, [layouts[name] for layouts, _ in two]


def test_logits_and_adapter_grads_match_peft_at_every_layout(runs):
    _, ref, _, _, _ = runs
    assert len(ref["grads"]) == 2 * len(lw.TARGETS) * TINY_LLAMA["num_hidden_layers"]
    assert max(v.abs().max().item() for v in ref["grads"].values()) > 1e-3  # not all zero
    for name, results in _layouts(runs):
        logits = (_stack(results, "logits") - ref["logits"]).abs().max().item()
        grads = _max_diff(results[0]["grads"], ref["grads"])
        print(f"{name}: logits {logits:.1e}, adapter grads {grads:.1e}")
        assert logits <= TOL and grads <= TOL, name


def test_attention_adapters_on_a_moe_model_match_peft_at_ep2(runs):
    *_, (ref, one) = runs
    two = runs[3]
    assert len(ref["grads"]) == 2 * len(lw.ATTENTION) * TINY_MIXTRAL["num_hidden_layers"]
    for name, results in (("1 rank", [one]), ("ep2", [lay["moe-ep2"] for lay, _ in two])):
        logits = (_stack(results, "logits") - ref["logits"]).abs().max().item()
        grads = _max_diff(results[0]["grads"], ref["grads"])
        # the adapted weights merged (transformers 5 names Mixtral's experts otherwise)
        merged = _max_diff(*({k: v for k, v in m.items() if ".self_attn." in k}
                             for m in (results[0]["merged"], ref["merged"])))  # fmt: skip
        print(f"mixtral {name}: logits {logits:.1e}, adapter grads {grads:.1e}")
        assert logits <= TOL and grads <= TOL and merged <= TOL, name
        assert all(r["base_grads"] == [] for r in results), name


def test_merged_weights_are_peft_merge_and_unload(runs):
    _, ref, _, _, _ = runs
    for name, results in _layouts(runs):
        assert _max_diff(results[0]["merged"], ref["merged"]) <= TOL, name


def test_the_base_alone_trains_nothing_and_the_adapters_off_give_the_base(runs):
    _, ref, one, two, _ = runs
    base = _stack([one], "base_logits")
    # B != 0 here, so the adapters move the logits; switched off, the model is the base
    assert (base - ref["logits"]).abs().max() > 1e-3
    for name, results in _layouts(runs):
        assert (_stack(results, "base_logits") - base).abs().max() <= TOL, name
        assert all(r["base_grads"] == [] for r in results), name
    # the optimizer holds the adapters only: rank x (in + out) per adapted linear
    h, f, q, kv = 64, 128, 64, 32
    per_layer = R * ((h + q) * 2 + (h + kv) * 2 + (h + f) * 3)  # q o, k v, gate up down
    assert one["optimizer_numel"] == per_layer * TINY_LLAMA["num_hidden_layers"]
    pp = [layouts["pp2"]["optimizer_numel"] for layouts, _ in two]
    assert pp == [per_layer * 2, per_layer * 2]


def test_a_written_adapter_loads_in_peft_with_the_same_logits(runs):
    import peft
    import transformers
    from safetensors.torch import load_file

    out, ref, _, _, _ = runs
    written, given = (
        load_file(f"{out}/export-2/adapter_model.safetensors"),
        load_file(f"{out}/adapter/adapter_model.safetensors"),
    )
    assert _max_diff(written, given) == 0.0  # read at TP2 / PP2, gathered back whole
    base = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/hf", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, f"{out}/export-2")
    logits = model(input_ids=token_batch()["tokens"]).logits
    assert (logits - ref["logits"]).abs().max() <= 1e-6


def test_a_checkpoint_resumes_at_another_layout(runs):
    _, _, _, two, _ = runs
    after = two[0][1]
    diff = _max_diff(after["tp2-sp"], after["pp2"])
    print(f"adapters after step 2, TP2+SP straight vs resumed at PP2: {diff:.1e}")
    assert 0 < len(after["pp2"]) and diff <= 1e-6
    # the checkpoint holds no base: a resume checks the one it rebuilt, at any layout
    fp = after["tp2-sp/fingerprint"]
    assert fp > 0 and abs(after["pp2/fingerprint"] - fp) <= 1e-12 * fp
    assert "ConfigError" in after["other base"] and "another base model" in after["other base"]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("role", ["critic", "reward"])
def test_a_lora_critic_and_reward_model_match_peft_sequence_classification(runs, role):
    """The critic (`model.critic_lora`) and a reward-model run's model (`model.lora`,
    `algorithm.name: rm`) against PEFT's SEQ_CLS adapters on transformers' one-label
    `LlamaForSequenceClassification`, its `score` head trained in full: the values at every
    position (transformers' own score is the last one's), the gradients of every adapter and
    of the head, at one rank and at TP2 with sequence parallelism (test_lora_stages trains
    both end to end)."""
    _, _, one, two, _ = runs
    ref = one["scalar"]["reference"]
    assert torch.allclose(ref["pooled"], ref["values"][:, -1], atol=1e-6)
    assert len(ref["grads"]) == 2 * len(lw.TARGETS) * TINY_LLAMA["num_hidden_layers"]
    assert min(v.abs().max().item() for v in ref["grads"].values()) > 1e-4  # every one moves
    for name, results in (("1 rank", [one["scalar"][role]]),
                          ("tp2-sp", [lay[f"{role}-tp2-sp"] for lay, _ in two])):  # fmt: skip
        values = (_stack(results, "values") - ref["values"]).abs().max().item()
        got = results[0]["grads"]
        assert got.keys() == ref["grads"].keys(), name
        grads = max(_rel(got[k], ref["grads"][k]) for k in got)
        head = max(_rel(r["head"], ref["head"].reshape(-1)) for r in results)
        print(f"{role} {name}: values {values:.1e}, adapter grads {grads:.1e}, head {head:.1e}")
        assert values <= TOL and grads <= TOL and head <= TOL, (role, name)
        assert all(r["base_grads"] == [] for r in results), (role, name)


def test_fresh_adapters_are_the_same_at_every_layout(runs):
    """Without `model.lora.init_from`: A drawn from trainer.seed and the adapter's name, whole,
    then sliced; B zero. The same adapters, bit for bit, at one rank, DP2, TP2 + SP, PP2 and
    PP2 x VPP2."""
    _, _, one, two, _ = runs
    fresh = one["fresh"]
    assert len(fresh) == 2 * len(lw.TARGETS) * TINY_LLAMA["num_hidden_layers"]
    a = [k for k in fresh if ".lora_A." in k]
    assert a and all(fresh[k].abs().max() > 0 for k in a)
    assert all(fresh[k].abs().max() == 0 for k in fresh if ".lora_B." in k)  # step 0: the base
    assert len({fresh[k].abs().sum().item() for k in a}) == len(a)  # each its own draw
    for name, got in two[0][0]["fresh"].items():
        assert got.keys() == fresh.keys(), name
        assert all(torch.equal(got[k], fresh[k]) for k in fresh), name


def test_an_adapter_that_does_not_fit_the_run_is_refused_naming_file_and_key(runs):
    """`model.lora.init_from`: the PEFT directory's rank, alpha and targets must be the run's."""
    from megarl.convert.peft import PeftError, read_adapter_config

    out = runs[0]
    path = f"{out}/adapter/adapter_config.json"
    read_adapter_config(f"{out}/adapter", LoraConfig(rank=R, alpha=ALPHA))
    for cfg, key in ((LoraConfig(rank=8, alpha=ALPHA), "r=4, the run has 8"),
                     (LoraConfig(rank=R, alpha=16.0), "lora_alpha=8.0, the run has 16.0"),
                     (LoraConfig(rank=R, alpha=ALPHA, targets=("q_proj", "v_proj")),
                      "target_modules=")):  # fmt: skip
        with pytest.raises(PeftError) as e:
            read_adapter_config(f"{out}/adapter", cfg)
        assert str(e.value).startswith(f"{path}: {key}"), str(e.value)
        assert "model.lora.rank / alpha / targets" in str(e.value)
    with pytest.raises(PeftError, match="model.lora.init_from='/no/such': no adapter_config"):
        read_adapter_config("/no/such", LoraConfig(rank=R, alpha=ALPHA))


def test_a_lora_policy_checkpoint_is_refused_as_a_model_source(runs):
    """A LoRA run's checkpoints hold the adapters, not the base: `model.mcore_ckpt` and
    `megarl convert mcore-to-hf` refuse one, naming the run's merged export and its adapter
    directory (one-line user errors, nothing built or written)."""
    from tests.docs_worker import in_one_process

    out = runs[0]
    ckpt = f"{out}/run/checkpoints/step_000001"  # resume_elsewhere's, written at TP2 + SP
    quiet = ["--set", "logging.wandb=false", "--set", "logging.progress=false"]
    jobs = [
        {"id": "train", "kind": "cli", "status": 2,
         "argv": ["train", "--set", f"model.mcore_ckpt={ckpt}", *quiet, "--out", f"{out}/t"]},
        {"id": "convert", "kind": "cli", "status": 2,
         "argv": ["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", f"{out}/c"]},
    ]  # fmt: skip
    results = in_one_process(jobs, pathlib.Path(out))
    for job in ("train", "convert"):
        _, text, _ = results[job]
        lines = [ln for ln in text.splitlines() if ln.startswith("megarl: error:")]
        assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
        assert f"{ckpt} holds the LoRA adapters of a LoRA run's actor, not its base" in lines[0]
        assert f"{out}/run/hf" in lines[0] and f"model.lora.init_from={out}/run/adapter" in (
            lines[0]
        )
    assert not os.path.exists(f"{out}/c") and not os.path.exists(f"{out}/t/config.yaml")


def test_settings_that_cannot_run_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="model.lora.targets.*qkv_proj"):
        LoraConfig(rank=8, targets=("qkv_proj",))
    with pytest.raises(ConfigError, match="model.lora.rank=-1"):
        LoraConfig(rank=-1)
    with pytest.raises(ConfigError, match="model.lora.rank=1024 with model.lora.merge=false"):
        load_config(overrides=["model.lora.rank=1024"])
    load_config(overrides=["model.lora.rank=1024", "model.lora.merge=true"])
    load_config("examples/sft_copy_cpu.yaml", ["model.lora.rank=1024"])  # no engine to serve it
    load_config(overrides=["algorithm.name=ppo", "model.critic_lora.rank=1024"])  # nor a critic's
    load_config(overrides=["model.lora.rank=8", "rollout.placement.mode=separate"])
    on = LoraConfig(rank=8)
    with pytest.raises(ConfigError, match="Transformer-Engine"):
        check_lora(on, arch_from_hf(TINY_LLAMA), tp=1, use_te=True)
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        check_lora(on, arch_from_hf(TINY_MIXTRAL), tp=1, use_te=False)
    check_lora(LoraConfig(rank=8, targets=("q_proj", "v_proj")), arch_from_hf(TINY_MIXTRAL),
               tp=1, use_te=False)  # fmt: skip
    from tests.tiny import TINY_DEEPSEEK_V3

    with pytest.raises(ConfigError, match="multi-latent-attention model .*model.lora.rank: 0"):
        check_lora(LoraConfig(rank=8, targets=("q_proj",)), arch_from_hf(TINY_DEEPSEEK_V3),
                   tp=1, use_te=False)  # fmt: skip
    with pytest.raises(ConfigError, match="dropout"):
        check_lora(LoraConfig(rank=8, dropout=0.1), arch_from_hf(TINY_LLAMA), tp=2, use_te=False)
