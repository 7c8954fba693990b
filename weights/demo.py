"""``coldstart demo DEST --shape tiny|small|llama-7b|llama3-8b|llama2-13b|llama3-70b``: a random Llama
checkpoint in HF format.

Writes what ``save_pretrained`` would: ``config.json``, ``generation_config.json``,
safetensors shards with ``model.safetensors.index.json`` when sharded, and a
tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a chat template)
trained locally with the ``tokenizers`` library, so no hub is needed. Weights
are random normal (std 0.02, like HF's init), norms are ones; they are made on
the given device (a GPU makes 7B in seconds) and streamed to disk one tensor at
a time, so host memory never holds a shard.

``force`` replaces only what this command made (its ``.coldstart-demo`` file says so) or an
empty directory; anything else is refused, with --force or without.

``layers``: the shape with fewer layers (a 70B's real widths on a disk that cannot hold it).
``tp``: a packed split pack (``coldstart pack --tp N``) written directly, without the HF
checkpoint: each random tensor is made once, as for the checkpoint, and the packer's writer
stores its ranks' slices; the same seed and device give what packing the checkpoint would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .format import align_up
from .quant import keeps_dtype
from .quantize import DEMO_FORMATS, demo_specs, demo_tensor


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    dtype: str
    shards: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0


SHAPES: dict[str, Shape] = {
    # serves on a CPU at once; the embedded default
    "tiny": Shape(64, 2, 4, 2, 176, 512, 1024, "float32", 1),
    # a few MB, sharded, bf16: exercises the multi-shard and cast paths
    "small": Shape(256, 4, 8, 4, 688, 1024, 2048, "bfloat16", 2),
    # the benchmark subject: Llama-2-7B's shapes, fp16, 13.5 GB in 3 shards
    "llama-7b": Shape(4096, 32, 32, 32, 11008, 32000, 4096, "float16", 3),
    # the grouped-query subject: Llama-3-8B's shapes (8 kv heads of 32, a 128,256 vocabulary), bf16,
    # 16.1 GB in 4 shards; its KV cache per position is a quarter of llama-7b's
    "llama3-8b": Shape(4096, 32, 32, 8, 14336, 128256, 8192, "bfloat16", 4, rope_theta=500000.0),
    # tensor-parallel subjects: Llama-2-13B (26 GB fp16) and Llama-3-70B (141 GB bf16, grouped-query)
    "llama2-13b": Shape(5120, 40, 40, 40, 13824, 32000, 4096, "float16", 3),
    "llama3-70b": Shape(8192, 80, 64, 8, 28672, 128256, 8192, "bfloat16", 30, rope_theta=500000.0),
}

_CORPUS = """\
The answer is forty-two. Cold starts are the time a new replica needs before it can answer.
A replica loads its weights, warms up its kernels and then takes traffic from the router.
Large language models generate text one token at a time; each step reads every weight once.
Memory bandwidth, not arithmetic, bounds decoding at batch size one.
Ray Serve routes requests only to replicas that passed their health check.
Hello! How can I help you today? Please tell me more about your question.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: + - * / = ( ) [ ] { } < > ! ? , . ; :
Über naïve café — 東京 and 北京 are cities; emoji: 🙂 🚀.
"""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>\n"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}{% endfor %}"
)


def tensor_specs(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a LlamaForCausalLM checkpoint, in save_pretrained's order."""
    hd = s.hidden // s.heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (s.heads * hd, s.hidden)),
            (p + "self_attn.k_proj.weight", (s.kv_heads * hd, s.hidden)),
            (p + "self_attn.v_proj.weight", (s.kv_heads * hd, s.hidden)),
            (p + "self_attn.o_proj.weight", (s.hidden, s.heads * hd)),
            (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.down_proj.weight", (s.hidden, s.intermediate)),
            (p + "input_layernorm.weight", (s.hidden,)),
            (p + "post_attention_layernorm.weight", (s.hidden,)),
        ]
    out.append(("model.norm.weight", (s.hidden,)))
    if not s.tie_embeddings:
        out.append(("lm_head.weight", (s.vocab, s.hidden)))
    return out


def config_dict(s: Shape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "vocab_size": s.vocab,
        "max_position_embeddings": s.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": s.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": s.tie_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": s.dtype,
        "initializer_range": 0.02,
        "attention_bias": False,
        "mlp_bias": False,
    }


def build_tokenizer(vocab_size: int):
    """A byte-level BPE trained on a small built-in corpus (ids 0-2: <unk> <s> </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 4096), special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    # BOS on every encode with special tokens, as Llama tokenizers do
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


_ST_CODE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "int32": "I32"}


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], str]], quant: str | None,
                       device: torch.device, gen: torch.Generator) -> None:
    """Stream random tensors (name, shape, dtype) into one safetensors file without holding them all."""
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, dtype in tensors:
        n = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        for d in shape:
            n *= d
        header[name] = {"dtype": _ST_CODE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (align_up(len(raw) + 8, 8) - len(raw) - 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in tensors:
            t = _random_tensor(name, shape, dtype, quant, device, gen)
            f.write(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def _random_tensor(name: str, shape: tuple[int, ...], dtype_name: str, quant: str | None, device: torch.device,
                   gen: torch.Generator) -> torch.Tensor:
    """One demo tensor, drawn from ``gen`` (norms: ones; a quantized projection's: weights.quantize)."""
    dtype = getattr(torch, dtype_name)
    if quant and (keeps_dtype(name) or not dtype.is_floating_point or dtype.itemsize == 1):
        return demo_tensor(name, shape, dtype_name, quant, device, gen)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)


def shape_of(shape: str, layers: int | None = None) -> Shape:
    """``SHAPES[shape]``, with ``layers`` layers (fewer than the shape's) and its shards in
    proportion where given; ValueError naming the choices otherwise."""
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is unknown; choose one of {', '.join(SHAPES)}")
    s = SHAPES[shape]
    if layers is None:
        return s
    if not isinstance(layers, int) or not 1 <= layers <= s.layers:
        raise ValueError(f"layers={layers!r}: the {shape} shape has {s.layers} layers; give 1 to {s.layers}")
    return dataclasses.replace(s, layers=layers, shards=max(1, round(s.shards * layers / s.layers)))


def make_demo(dest: str | os.PathLike, shape: str = "tiny", *, device: str = "cpu",
              seed: int = 0, force: bool = False, layers: int | None = None, tp: int = 1,
              quant: str | None = None) -> Path:
    """Write a random Llama-family HF checkpoint to ``dest`` (atomically).

    Args:
        dest: directory to create.
        shape: one of ``SHAPES`` (tiny, small, llama-7b, llama3-8b, llama2-13b, llama3-70b).
        device: where random weights are drawn (``cuda`` makes 7B in seconds).
        seed: RNG seed: the same seed and device give the same weights.
        force: replace ``dest`` if it exists and is a checkpoint this function wrote or an empty
            directory (with ``tp``: a packed model or an empty directory, as ``pack``).
        layers: write this many layers of the shape (its other sizes unchanged).
        tp: above 1, write a packed split pack over ``tp`` ranks instead of the checkpoint (see
            the module's docstring).
        quant: write the checkpoint quantized in this format (``weights.quantize.DEMO_FORMATS``:
            fp8, fp8-tensor, fbgemm-fp8, fp8-block, awq, gptq, gptq-act-order), its projections
            random in the format's layout and config.json with its quantization_config.
    """
    if quant is not None and quant not in DEMO_FORMATS:
        raise ValueError(f"quant={quant!r} is unknown; choose one of {', '.join(DEMO_FORMATS)}")
    s = shape_of(shape, layers)
    dest = Path(dest)
    if tp == 1 and (dest.exists() or dest.is_symlink()) and not _made_here(dest):
        raise FileExistsError(f"{dest} exists and is not a checkpoint `coldstart demo` made (no {MARKER}) nor an "
                              "empty directory; it will not be replaced, with --force or without: choose another DEST")
    if dest.exists() and not force:
        raise FileExistsError(f"{dest} exists; pass --force to replace it")
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    specs = [(n, shp, s.dtype) for n, shp in tensor_specs(s)]
    if quant:
        specs = demo_specs([(n, shp) for n, shp, _ in specs], quant, s.dtype)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if tp > 1:
        return _write_split(dest, s, f"demo-{shape}", specs, quant, dev, gen, tp, force)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        per = -(-len(specs) // s.shards)
        groups = [specs[i * per:(i + 1) * per] for i in range(s.shards)]
        weight_map = {}
        for i, g in enumerate(groups):
            fname = ("model.safetensors" if s.shards == 1 else
                     f"model-{i + 1:05d}-of-{s.shards:05d}.safetensors")
            _write_safetensors(tmp / fname, g, quant, dev, gen)
            weight_map.update({n: fname for n, _, _ in g})
        if s.shards > 1:
            total = sum(os.path.getsize(tmp / f) for f in set(weight_map.values()))
            _dump(tmp / "model.safetensors.index.json",
                  {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_side_files(tmp, s, quant)
        _dump(tmp / MARKER, {"shape": shape, "layers": s.layers, "seed": seed, "device": str(dev), "quant": quant})
        from .publish import swap_in
        swap_in(tmp, dest)  # (replaceable: checked above)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


MARKER = ".coldstart-demo"  # in a checkpoint make_demo wrote: what --force may replace


def _made_here(dest: Path) -> bool:
    return dest.is_dir() and not dest.is_symlink() and ((dest / MARKER).is_file() or not any(dest.iterdir()))


def _write_side_files(d: Path, s: Shape, quant: str | None = None) -> None:
    """config.json (with ``quant``'s quantization_config), generation_config.json and the tokenizer's files."""
    config = config_dict(s)
    if quant:
        config["quantization_config"] = DEMO_FORMATS[quant]
    _dump(d / "config.json", config)
    _dump(d / "generation_config.json",
          {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False, "max_length": s.max_positions})
    tok = build_tokenizer(s.vocab)
    tok.save(str(d / "tokenizer.json"))
    _dump(d / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": s.max_positions, "chat_template": CHAT_TEMPLATE})
    _dump(d / "special_tokens_map.json",
          {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def _write_split(dest: Path, s: Shape, source: str, specs: list[tuple[str, tuple[int, ...], str]], quant: str | None,
                 dev: torch.device, gen: torch.Generator, tp: int, force: bool) -> Path:
    """The split pack of the checkpoint ``make_demo`` would write, through the packer's writer:
    the side files from a temporary directory, each random tensor drawn in the checkpoint's
    order and handed over as it is made (one in host memory at a time)."""
    from .packer import PackOptions, write_pack
    from .sources import SourceTensor

    where = Path(f"<random {source}>")
    metas = {name: SourceTensor(name, where, dtype, shape) for name, shape, dtype in specs}
    tensors = ((name, _random_tensor(name, shape, dtype, quant, dev, gen).cpu(), where) for name, shape, dtype in specs)
    with tempfile.TemporaryDirectory(prefix="coldstart-demo-side-") as side:
        _write_side_files(Path(side), s, quant)
        return write_pack(Path(side), dest, metas, tensors, {}, PackOptions(tp=tp, force=force), source=source)


def _dump(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
