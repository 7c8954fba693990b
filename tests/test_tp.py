"""Tensor parallelism: the slicing rules, split packs (pack, verify, load), and the decoder split
over 2 and 4 real processes (gloo on the CPU) against the one-device model and transformers."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deployments.model import build_model
from helpers_engine import hf_greedy, hf_model, random_biases, state_tensors
from helpers_tp import model_runs, rank_model_runs, run_ranks
from weights import PackedFormatError, PackOptions, TensorParallelPackError, load, make_demo, pack, read_packed, verify
from weights import tp
from weights.format import PREAMBLE_BYTES

ROOT = Path(__file__).resolve().parents[1]
# MLP rows that split over 2 and 4 ranks into whole 4 KiB pages (the fused views need them back to back)
COMMON = dict(intermediate_size=128)

# ----------------------------------------------------------------------------- the rules


LAYOUT_CONFIG = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 96,
                 "vocab_size": 97}


def test_layout_needs_heads_kv_heads_and_mlp_rows_that_divide_over_the_ranks(tiny_hf, tmp_path):
    lay = tp.layout(LAYOUT_CONFIG, 4)
    assert (lay.heads_per_rank, lay.kv_per_rank, lay.kv_replicated, lay.intermediate_per_rank,
            lay.vocab_per_rank, lay.vocab_padded) == (2, 1, True, 24, 25, 100)
    assert not tp.layout(LAYOUT_CONFIG, 2).kv_replicated
    assert tp.rank_config(LAYOUT_CONFIG, 4) == {**LAYOUT_CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1,
                                                "head_dim": 8, "intermediate_size": 24, "vocab_size": 25}
    for patch, n, msg in [({}, 3, r"num_attention_heads \(8\) is not a multiple of 3"),
                          ({"num_attention_heads": 12, "num_key_value_heads": 6}, 4,
                           r"num_key_value_heads \(6\) must be a multiple of 4 .* or divide it"),
                          ({"intermediate_size": 100}, 8, r"intermediate_size \(100\) is not a multiple of 8"),
                          ({"vocab_size": None}, 2, r"`vocab_size` must be a positive int")]:
        with pytest.raises(ValueError, match=msg):
            tp.layout({**LAYOUT_CONFIG, **patch}, n)
    with pytest.raises(ValueError, match="has no tensor-parallel rule"):
        tp.rule("transformer.h.0.attn.c_attn.weight")
    r = _cli("pack", str(tiny_hf), str(tmp_path / "p"), "--tp", "3")  # the tiny demo has 4 heads
    assert r.returncode == 2 and "num_attention_heads (4) is not a multiple of 3" in r.stderr, r.stderr
    assert not (tmp_path / "p").exists()


def test_replicated_kv_heads_go_to_the_ranks_whose_query_heads_read_them():
    lay = tp.layout(LAYOUT_CONFIG, 4)  # 8 heads, 2 kv heads: heads 0-3 read kv head 0, heads 4-7 kv head 1
    q = torch.arange(64 * 3.0).view(64, 3)  # 8 heads of 8 rows
    k = torch.arange(16 * 3.0).view(16, 3)  # 2 kv heads of 8 rows
    for r in range(4):
        heads = tp.shard("model.layers.0.self_attn.q_proj.weight", q, lay, r)
        assert torch.equal(heads, q[16 * r: 16 * (r + 1)])  # query heads 2r, 2r+1
        kv = {h // 4 for h in (2 * r, 2 * r + 1)}  # the kv head those read (n_rep = 4)
        assert len(kv) == 1
        assert torch.equal(tp.shard("model.layers.0.self_attn.k_proj.weight", k, lay, r), k[8 * kv.pop():][:8])


@pytest.fixture(scope="module")
def split_pack(tmp_path_factory):
    """A tiny Llama with o_proj and MLP biases and a vocabulary of 97, split over 2 ranks by the CLI."""
    root = tmp_path_factory.mktemp("split")
    hf, _ = hf_model("llama", **COMMON, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                     attention_bias=True, mlp_bias=True)
    random_biases(hf)
    hf.save_pretrained(root / "hf")
    r = _cli("pack", str(root / "hf"), str(root / "p"), "--tp", "2", "-q")
    assert r.returncode == 0 and "packed 35 tensors split over 2 ranks" in r.stdout, r.stdout + r.stderr
    return root


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.tools.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_each_rank_holds_its_slices_of_the_source_and_they_make_it_whole(split_pack):
    src = load_file(split_pack / "hf" / "model.safetensors")
    config = json.loads((split_pack / "hf" / "config.json").read_text())
    lay = tp.layout(config, 2)
    ranks = [load(split_pack / "p", "cpu", rank=k) for k in range(2)]
    assert [m.tp for m in ranks] == [{"size": 2, "rank": 0}, {"size": 2, "rank": 1}]
    assert all(m.path == split_pack / "p" and m.config == config for m in ranks)  # the pack's side files
    by_dir = load(split_pack / "p" / "rank-1", "cpu")
    assert set(src) == set(ranks[0].tensors) == set(by_dir.tensors)
    kinds = set()
    for name, t in src.items():
        parts = [m.tensors[name] for m in ranks]
        assert all(torch.equal(p, tp.shard(name, t, lay, k)) for k, p in enumerate(parts)), name
        assert torch.equal(by_dir.tensors[name], parts[1])
        kind = tp.rule(name)
        kinds.add(kind)
        if kind in (tp.Q_ROWS, tp.KV_ROWS, tp.MLP_ROWS):  # (2 kv heads over 2 ranks: split)
            assert torch.equal(torch.cat(parts), t), name
        elif kind in (tp.Q_COLUMNS, tp.MLP_COLUMNS):
            assert torch.equal(torch.cat(parts, 1), t), name
        elif kind == tp.VOCAB:  # 97 rows: 49 on each rank, the last one zero padding
            assert parts[0].shape[0] == 49 and torch.equal(torch.cat(parts)[:97], t), name
            assert not torch.cat(parts)[97:].any()
        elif kind == tp.FIRST:  # o_proj / down_proj bias: added once by the all-reduce
            assert torch.equal(parts[0], t) and not parts[1].any() and t.any(), name
        else:
            assert kind == tp.REPLICATED and all(torch.equal(p, t) for p in parts), name
    assert kinds == {tp.Q_ROWS, tp.KV_ROWS, tp.Q_COLUMNS, tp.MLP_ROWS, tp.MLP_COLUMNS, tp.FIRST, tp.VOCAB,
                     tp.REPLICATED}
    for m in ranks:  # q/k/v and gate/up back to back in every rank's file: the fused views apply
        at = {e.name: e for e in m.packed.tensors}
        for group in (["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]):
            es = [at[next(n for n in at if n.startswith("model.layers.1.") and f".{g}.weight" in n)] for g in group]
            assert all(a.offset + a.nbytes == b.offset for a, b in zip(es, es[1:])), group


def test_verify_checks_every_rank_and_names_the_bad_one(split_pack, tmp_path):
    d = shutil.copytree(split_pack / "p", tmp_path / "p")
    r = _cli("verify", str(d))
    assert r.returncode == 0 and "(rank 0 of 2, " in r.stdout and "(rank 1 of 2, " in r.stdout, r.stdout
    with open(d / "rank-1" / "model.cst", "r+b") as f:  # a flipped byte in rank 1's data
        f.seek(PREAMBLE_BYTES + 100)
        b = f.read(1)
        f.seek(PREAMBLE_BYTES + 100)
        f.write(bytes([b[0] ^ 0x10]))
    r = _cli("verify", str(d))
    assert r.returncode == 1, r.stdout
    assert f"{d / 'rank-1' / 'model.cst'} (rank 1 of 2): checksum mismatch in chunk 0" in r.stderr, r.stderr
    assert "rank-0" not in r.stderr and "FAILED: rank 1: 1 bad chunk(s) (of 2 ranks)" in r.stderr, r.stderr
    report = verify(d)
    assert not report.ok and [x.ok for x in report.ranks] == [True, False]
    with pytest.raises(PackedFormatError, match=r"rank-1/model.cst: checksum mismatch in chunk 0"):
        load(d, "cpu", rank=1)
    load(d, "cpu", rank=0)
    (d / "rank-1" / "model.cst").unlink()
    r = _cli("verify", str(d))
    assert r.returncode == 1 and f"rank 1 of 2: {d / 'rank-1' / 'model.cst'}: missing from the split pack {d}; " \
        "copy the pack again" in r.stderr and "FAILED: rank 1: its file refused (above)" in r.stderr, r.stderr


def test_a_split_pack_given_as_one_model_says_how_to_load_a_rank(split_pack, tiny_packed):
    from deployments.tools.cli import packed_model

    d = split_pack / "p"
    for call in (lambda: load(d, "cpu"), lambda: read_packed(d), lambda: packed_model(d)):
        with pytest.raises(TensorParallelPackError, match=r"split over 2 ranks .* weights\.load\(.*, rank=K\)"):
            call()
    with pytest.raises(ValueError, match=r"rank=2: .* is split over 2 ranks, 0 to 1"):
        load(d, "cpu", rank=2)
    with pytest.raises(ValueError, match=r"is not a tensor-parallel pack \(no tp\.json\)"):
        load(tiny_packed, "cpu", rank=0)
    r = _cli("kernels", str(d))  # (before anything starts)
    assert r.returncode == 2 and f"{d} is split over 2 tensor-parallel ranks: `coldstart kernels` keeps the " \
        "kernels of a one-device pack only" in r.stderr, r.stderr


def test_a_rank_file_moved_or_from_another_pack_is_refused(split_pack, tmp_path):
    d = shutil.copytree(split_pack / "p", tmp_path / "p")
    shutil.copy(d / "rank-1" / "model.cst", d / "rank-0" / "model.cst")
    with pytest.raises(PackedFormatError, match=r"holds the weights of rank 1 of 2 but lies in rank-0/"):
        load(d, "cpu", rank=0)
    shutil.copy(split_pack / "p" / "rank-0" / "model.cst", d / "rank-0" / "model.cst")
    other = pack(split_pack / "hf", tmp_path / "other", PackOptions(tp=2, progress=False))  # the same weights
    shutil.copy(other / "rank-1" / "model.cst", d / "rank-1" / "model.cst")
    with pytest.raises(PackedFormatError, match=r"tp\.json: changed since packing"):
        load(d, "cpu", rank=1)
    assert any("tp.json: changed since packing" in p for p in verify(d).problems())


def test_split_packs_keep_the_force_atomicity_and_leftover_rules(split_pack, tmp_path, caplog):
    src, out = split_pack / "hf", tmp_path / "out"
    opts = PackOptions(tp=2, progress=False)
    pack(src, out / "p", opts)
    with pytest.raises(FileExistsError, match="pass --force"):
        pack(src, out / "p", opts)
    pack(src, out / "p", PackOptions(force=True, progress=False))  # a split pack replaced by a plain one
    assert verify(out / "p").ok and not (out / "p" / "tp.json").exists()
    pack(src, out / "p", PackOptions(tp=2, force=True, progress=False))  # and back
    assert verify(out / "p").ok and (out / "p" / "rank-1" / "model.cst").is_file()
    with pytest.raises(ValueError, match="lies inside SRC"):
        pack(src, src / "p", opts)
    # killed after rank 0's header: no DEST, nothing that loads, and the next pack removes it
    kill = ("import os, signal; from weights import PackOptions, pack, packer; real = packer._pwrite_all; "
            "packer._pwrite_all = lambda fd, buf, off, f, name: (real(fd, buf, off, f, name), "
            "name == 'header' and os.kill(os.getpid(), signal.SIGKILL)); "
            f"pack({str(src)!r}, {str(tmp_path / 'k' / 'p')!r}, PackOptions(tp=2, progress=False))")
    assert subprocess.run([sys.executable, "-c", kill], cwd=ROOT, timeout=300).returncode == -signal.SIGKILL
    (left,) = (tmp_path / "k").glob(".p.partial-*")
    assert (left / "rank-0" / "model.cst.partial").read_bytes()[:8] == b"CLDSTRT\x00"  # it got that far
    assert not list(left.rglob("model.cst")) and not (tmp_path / "k" / "p").exists()
    shutil.copytree(out / "p", tmp_path / "k" / ".p.partial-99999999-abcd_123")  # one complete, unpublished
    for d in (left, tmp_path / "k" / ".p.partial-99999999-abcd_123"):
        for check in (lambda: read_packed(d / "rank-0"), lambda: load(d, "cpu", rank=0), lambda: verify(d)):
            with pytest.raises(PackedFormatError, match="leftover of an interrupted `coldstart pack`"):
                check()
    with caplog.at_level("INFO", logger="weights"):
        pack(src, tmp_path / "k" / "p", opts)
    assert [p.name for p in (tmp_path / "k").iterdir()] == ["p"] and verify(tmp_path / "k" / "p").ok
    assert sum(r.getMessage().startswith("removed ") for r in caplog.records) == 2


# ----------------------------------------------------------------------------- the demo


def test_demo_shapes_have_the_real_models_sizes():
    from weights.demo import SHAPES, config_dict, tensor_specs

    params = {n: sum(math.prod(s) for _, s in tensor_specs(SHAPES[n])) for n in ("llama2-13b", "llama3-70b")}
    assert 13.0e9 < params["llama2-13b"] < 13.1e9 and 70.5e9 < params["llama3-70b"] < 70.6e9
    c = config_dict(SHAPES["llama3-70b"])
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["intermediate_size"], c["vocab_size"], c["rope_theta"]) == (8192, 80, 64, 8, 28672, 128256, 500000.0)
    c = config_dict(SHAPES["llama2-13b"])
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["intermediate_size"], c["vocab_size"]) == (5120, 40, 40, 40, 13824, 32000)
    assert tp.layout(config_dict(SHAPES["llama3-70b"]), 8).kv_per_rank == 1


def test_demo_writes_fewer_layers_and_split_packs_equal_to_packing_its_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"layers=5: the small shape has 4 layers"):
        make_demo(tmp_path / "x", "small", layers=5)
    hf = make_demo(tmp_path / "hf", "small", layers=1)
    assert json.loads((hf / "config.json").read_text())["num_hidden_layers"] == 1
    assert not any("layers.1." in n for f in hf.glob("*.safetensors") for n in load_file(f))
    packed = pack(hf, tmp_path / "packed", PackOptions(tp=2, progress=False))
    r = _cli("demo", str(tmp_path / "split"), "--shape", "small", "--layers", "1", "--tp", "2")
    assert r.returncode == 0 and "split over 2 ranks" in r.stdout, r.stderr
    assert verify(tmp_path / "split").ok
    for k in range(2):
        a, b = load(packed, "cpu", rank=k), load(tmp_path / "split", "cpu", rank=k)
        assert set(a.tensors) == set(b.tensors) and a.config == b.config
        assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


# ----------------------------------------------------------------------------- the decoder, split


# Tiny models whose every rank's q/k/v and gate/up slices are whole 4 KiB pages (so the packer
# lays them back to back and the fused views apply); vocab_size 97 (helpers_engine.TINY) is a
# multiple of neither 2 nor 4, so the last rank's vocabulary slice is padded.
MODEL_CASES = {
    # kv heads split over 2 and over 4 ranks
    "llama-kv4": ("llama", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4)),
    # kv heads split over 2 ranks, replicated over 4 (each on two ranks); o_proj and MLP biases
    "llama-kv2-bias": ("llama", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                     attention_bias=True, mlp_bias=True)),
    # 4 heads, 2 kv heads: one query head per rank over 4; sliding window
    "mistral-window": ("mistral", dict(sliding_window=5)),
    # q/k/v biases, tied embeddings (no lm_head.weight in the checkpoint)
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
}
TOKENS = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
PROMPTS = [[3, 5, 7, 11, 13, 17], [9] * 7, [2, 4, 6]]
STEPS = 8


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    """Every case packed whole and split over 2 and 4 ranks; the one-device model's and
    transformers' results; and every rank's, from one world of 4 processes (TP=4 over all of
    them, TP=2 over ranks 0-1 and over 2-3)."""
    root = tmp_path_factory.mktemp("tp-models")
    refs, jobs = {}, []
    for case, (arch, kw) in MODEL_CASES.items():
        hf, cfg = hf_model(arch, **COMMON, **kw)
        random_biases(hf)
        hf.save_pretrained(root / case / "hf")
        for n in (2, 4):
            pack(root / case / "hf", root / case / f"tp{n}", PackOptions(tp=n, progress=False))
            jobs.append((case, n, str(root / case / f"tp{n}")))
        with torch.no_grad():
            refs[case] = {"one": model_runs(build_model(cfg, state_tensors(hf)), TOKENS, PROMPTS, STEPS),
                          "hf_logits": hf(TOKENS).logits, "hf_greedy": [hf_greedy(hf, p, STEPS) for p in PROMPTS],
                          "packed": root / case}
    out = root / "out"
    out.mkdir()
    run_ranks(4, rank_model_runs, {"jobs": jobs, "out": str(out), "tokens": TOKENS, "prompts": PROMPTS,
                                   "steps": STEPS})
    got = {(case, n): [torch.load(out / f"{case}-tp{n}-rank{r}.pt") for r in range(4)] for case, n, _ in jobs}
    return refs, got


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", MODEL_CASES)
def test_split_model_computes_what_one_device_and_transformers_compute(split_runs, case, n):
    refs, got = split_runs
    ranks, one, hf = got[case, n], refs[case]["one"], refs[case]
    assert [r["tp"] for r in ranks] == [(k % n, n) for k in range(4)]
    for r in ranks[1:]:  # every rank ends every step with the same logits
        for key in ("logits", "step_logits", "logits_fused", "step_logits_fused"):
            assert torch.equal(r[key], ranks[0][key]), key
    r = ranks[0]
    assert all(x["fused_views"] for x in ranks)  # the zero-copy q/k/v and gate/up views, on every rank
    assert r["vocab_size"] == 97 and r["logits"].shape == one["logits"].shape == (2, 16, 97)
    kv_heads = MODEL_CASES[case][1].get("num_key_value_heads", 2)
    assert r["cache_kv_heads"] == max(1, kv_heads // n)  # a rank caches the kv heads its queries read, no more
    tight = dict(atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(r["logits"], one["logits"], **tight)
    torch.testing.assert_close(r["logits"], hf["hf_logits"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r["step_logits"], one["step_logits"], **tight)
    torch.testing.assert_close(r["logits_fused"], one["logits_fused"], **tight)
    torch.testing.assert_close(r["step_logits_fused"], one["step_logits_fused"], **tight)
    assert r["greedy"] == r["greedy_fused"] == one["greedy"] == hf["hf_greedy"]
    if case == "qwen2-tied":  # the head is the embedding's slice: the checkpoint has no lm_head.weight
        assert "lm_head.weight" not in {t.name for t in read_packed(hf["packed"] / f"tp{n}" / "rank-0").tensors}


def test_a_rank_built_in_a_group_of_another_size_names_its_rank(split_runs):
    _, got = split_runs
    msg = got["llama-kv4", 2][3]["wrong_group"]
    assert "do not match rank 3 of 4's slice of config.json" in msg and "weights.load(DEST, rank=3)" in msg
    msg = got["llama-kv4", 4][0]["not_native"]
    assert "tensor parallelism needs the native decoder" in msg and "hidden_act='quick_gelu'" in msg
