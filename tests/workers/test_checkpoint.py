"""Reading a Llama-family folder straight into the lean layout (workers.checkpoint): every tensor equal to
`llama.from_hf` of the transformers-loaded model, for each family and layout it takes; anything it
cannot state exactly left to transformers, naming why; and a worker that loads this way never imports
transformers' model code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from workers import checkpoint, llama
from workers.runner import TorchRunner, load, load_model

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama-biased-untied": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "tie_word_embeddings": False, "rope_theta": 5e5}),
    "llama-tied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24, "tie_word_embeddings": False}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None, "tie_word_embeddings": False}),
}


def save(folder: Path, family: str, *, seed: int = 0, shard: bool = False, **extra: Any) -> Path:
    config_class, model_class, options = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**SHAPE, **{**options, **extra}))
    for p in model.parameters():  # random norms and biases too, so a swapped tensor cannot pass
        p.data.normal_()
    model.save_pretrained(str(folder), max_shard_size="100KB" if shard else "5GB")
    return folder


def assert_same(direct: llama.LlamaWeights, reference: llama.LlamaWeights) -> None:
    for field in ("heads", "kv_heads", "head_dim", "eps", "rope_scale"):
        assert getattr(direct, field) == getattr(reference, field), field
    for field in ("inv_freq", "embed", "norm", "lm_head"):
        a, b = getattr(direct, field), getattr(reference, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
    assert len(direct.layers) == len(reference.layers)
    for mine, theirs in zip(direct.layers, reference.layers, strict=True):
        for field in ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "q_norm", "k_norm", "post_norm", "gate_up", "down"):
            a, b = getattr(mine, field), getattr(theirs, field)
            assert (a is None) == (b is None), (mine.index, field)
            assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), (mine.index, field)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_reads_into_the_weights_transformers_loads(family: str, dtype: torch.dtype, tmp_path: Path) -> None:
    folder = save(tmp_path / family, family, shard=family == "llama-biased-untied")
    assert (folder / checkpoint.INDEX).exists() == (family == "llama-biased-untied")  # the sharded layout is read too
    direct, why = checkpoint.load(folder, max_len=256, device=CPU, dtype=dtype)
    assert direct is not None, why
    assert_same(direct, llama.from_hf(load_model(folder, device=CPU, dtype=dtype)))
    assert (direct.lm_head is direct.embed) == FAMILIES[family][2]["tie_word_embeddings"]


@pytest.mark.model
def test_the_default_model_reads_into_the_weights_transformers_loads(default_model_folder: Path) -> None:
    direct, why = checkpoint.load(default_model_folder, max_len=8192, device=CPU, dtype=torch.bfloat16)
    assert direct is not None, why
    assert_same(direct, llama.from_hf(load_model(default_model_folder, device=CPU, dtype=torch.bfloat16)))


def test_what_it_cannot_state_exactly_is_left_to_transformers_naming_why(tmp_path: Path) -> None:
    def refused(folder: Path) -> str:
        weights, why = checkpoint.load(folder, max_len=256, device=CPU, dtype=torch.float32)
        assert weights is None and why is not None
        model, lean, _config = load(folder, device=CPU, dtype=torch.float32, model_impl="auto", max_len=256)
        assert model is not None and lean is None  # transformers loads it, as before
        return why

    scaled = save(tmp_path / "llama3", "llama-tied", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    assert "RoPE type 'llama3'" in refused(scaled)
    assert TorchRunner(load_model(scaled, device=CPU, dtype=torch.float32), max_len=256, kv_budget_mb=4, device=CPU, dtype=torch.float32).lean is not None  # the lean path still runs it, loaded so

    unstated = save(tmp_path / "unstated", "llama-tied")
    config = json.loads((unstated / "config.json").read_text())
    del config["rms_norm_eps"]  # transformers' default for the family; another family's may differ
    (unstated / "config.json").write_text(json.dumps(config))
    assert "does not state rms_norm_eps" in refused(unstated)
    qwen3 = json.loads((save(tmp_path / "qwen3", "qwen3") / "config.json").read_text())
    assert checkpoint.why_not({k: v for k, v in qwen3.items() if k != "head_dim"}, max_len=256) == "config.json does not state head_dim"  # Qwen3's default is 128, not hidden / heads

    extra = save(tmp_path / "extra", "llama-tied")
    tensors = load_file(str(extra / "model.safetensors"))
    save_file({**tensors, "model.layers.0.mlp.gate_proj.bias": torch.zeros(SHAPE["intermediate_size"])}, str(extra / "model.safetensors"), metadata={"format": "pt"})
    assert "model.layers.0.mlp.gate_proj.bias" in refused(extra)

    biased = save(tmp_path / "biased", "llama-tied", attention_bias=True)
    config = json.loads((biased / "config.json").read_text())
    config["attention_bias"] = False  # the file says no biases, the tensors have them: transformers decides
    (biased / "config.json").write_text(json.dumps(config))
    assert "self_attn.k_proj.bias" in refused(biased)

    weights, why = checkpoint.load(save(tmp_path / "windowed", "mistral", sliding_window=128), max_len=256, device=CPU, dtype=torch.float32)
    assert weights is None and why == "sliding window 128 < max_len 256"


@pytest.mark.model
@pytest.mark.timeout(300)
def test_a_worker_on_the_default_model_never_imports_transformers_model_code() -> None:
    """A worker's start without transformers' model code, torch._dynamo or peft (~1.5 s of CPU and
    ~250 MB less: bench/start_cost.py); the engine it builds runs a request and scores a prompt."""
    code = (
        "import json, os, sys\n"
        "from dataclasses import replace\n"
        "from shared.ir import Message, Protocol, Request, Role, SamplingParams, TextPart\n"
        "from shared.deltas import Content\n"
        "from shared.settings import Settings\n"
        "from workers.main import build_engine\n"
        "engine, info = build_engine(replace(Settings.from_env(os.environ), kv_budget_mb=64))\n"
        "msg = Message(role=Role.USER, content=(TextPart(text='Name a colour.'),))\n"
        "req = Request(id='r', protocol=Protocol.OPENAI_CHAT, model='m', messages=(msg,), sampling=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))\n"
        "engine.add(replace(req, prompt_token_ids=tuple(engine.tokenizer.encode('Name a colour, please.'))))\n"
        "tokens = []\n"
        "while engine.has_work():\n"
        "    tokens += [t for e in engine.step() if isinstance(e.delta, Content) for t in e.delta.token_ids]\n"
        "scored = engine.runner.score_prompt([504, 3575, 282, 4649, 314], 2)\n"
        "loaded = {m: m in sys.modules for m in ('transformers.modeling_utils', 'torch._dynamo', 'peft', 'accelerate')}\n"
        "print(json.dumps({'info': info, 'tokens': len(tokens), 'scored': len(scored), 'loaded': loaded}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["info"]["model_impl"] == "lean" and out["tokens"] == 4 and out["scored"] == 4
    assert not any(out["loaded"].values()), out["loaded"]
