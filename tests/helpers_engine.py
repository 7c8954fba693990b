"""Shared helpers for the engine tests: tiny random HF checkpoints and a trained byte-level BPE."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def hf_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> tuple[torch.nn.Module, dict]:
    """A tiny random transformers model (fp32, eval) and its config.json dict."""
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
        "opt": (transformers.OPTConfig, transformers.OPTForCausalLM),
    }[arch]
    kw = dict(TINY) if arch in ("llama", "mistral", "qwen2") else {}
    kw.update(overrides)
    torch.manual_seed(seed)
    cfg = cls_cfg(**kw)
    cfg.architectures = [cls_model.__name__]
    model = cls_model(cfg).eval()
    # random init gives near-uniform logits; sharpen so greedy choices are far from ties
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model, json.loads(cfg.to_json_string())


def random_biases(hf: torch.nn.Module) -> torch.nn.Module:
    """Biases that matter (transformers initialises them to zeros), and norm weights that are not all ones."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(len(name)))
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return hf


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint tensors as a loader would hand them over (detached clones)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_bpe(vocab_size: int = 300) -> Any:
    """A tiny byte-level BPE (tokenizers library) trained on a few sentences, multi-byte text included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "Hello world, this is a tiny tokenizer.",
        "The quick brown fox jumps over the lazy dog.",
        "Grüße aus Köln! 日本語のテキスト。 emoji 🙂 too.",
        "Stop here. Then continue with more words and more words.",
    ] * 5
    tok.train_from_iterator(corpus, trainer)
    return tok


def write_tokenizer_dir(d: Path, *, chat_template: str | None = None, add_bos: bool | None = True) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    train_bpe().save(str(d / "tokenizer.json"))
    cfg: dict[str, Any] = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if add_bos is not None:
        cfg["add_bos_token"] = add_bos
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    return d


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate, eos disabled, new tokens only."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def engine_greedy_matches_transformers(model: Any, hf: torch.nn.Module, *, steps: int = 10, timeout: float = 120,
                                       **cfg: Any) -> dict:
    """Two prompts of different lengths through an engine over ``model`` at once: each one's greedy
    tokens equal transformers' (``hf``). ``cfg``: EngineConfig fields over 2 slots of 64 positions
    and 4-token chunks. Returns the engine's stats after the run."""
    from deployments.engine import Engine, EngineConfig, SamplingParams
    eng = Engine(model, None, EngineConfig(**{"max_slots": 2, "max_seq_len": 64, "prefill_chunk": 4, **cfg}))
    eng.start()
    try:
        prompts = [[3, 5, 7, 11, 13], [9] * 7]
        hs = [eng.submit(p, SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)) for p in prompts]
        for p, h in zip(prompts, hs):
            assert h.result(timeout=timeout)[0] == hf_greedy(hf, p, steps)
        return eng.stats()
    finally:
        eng.shutdown()


GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 5, 7, 11, 13, 17, 19], [2, 4], [9] * 13, [1, 50, 60, 70, 80], [42]]


def make_engine(arch: str = "llama", tokenizer: Any = None, start: bool = True, hf_kw: dict | None = None,
                device: str = "cpu", **cfg: Any) -> tuple[Any, torch.nn.Module]:
    """An engine over a tiny random model of ``arch`` (and that transformers model), started unless
    ``start`` is False; ``cfg``: EngineConfig fields over the tests' small defaults."""
    from deployments.engine import Engine, EngineConfig
    from deployments.model import build_model

    hf, config = hf_model(arch, **(hf_kw or {}))
    model = build_model(config, {k: v.to(device) for k, v in state_tensors(hf).items()})
    # prefill_min_len 16: the tests' short chunks keep a few padded lengths (the default 128 is for 7B-sized chunks)
    eng = Engine(model, tokenizer, EngineConfig(**{"max_slots": 4, "max_seq_len": 64, "prefill_chunk": 4,
                                                   "prefill_min_len": 16, **cfg}))
    if start:
        eng.start()
    return eng, hf
