"""Train the shipped arithmetic demo model: two-number addition (``37+45=`` → ``82`` then a newline).

Reproduces ``src/hetforge/assets/arith-demo/``: a tiny Llama-style model over bytes (vocabulary 128 = ASCII,
no tokenizer file: hetforge's byte-level tokenizer is the identity on ASCII) whose end-of-text token is the
newline, so an answer stops by itself. Every pair ``a+b`` with ``0 <= a, b < 100`` is a problem; a seeded
split holds back ``--test`` of them as the test set (written to ``training.json`` and used by
``bench/select.py``); the rest are the training set. The loss is on the answer bytes only.

The model is deliberately small and briefly trained (``--steps``) so that greedy decoding is right on only part
of the test set: the point of the model is to measure what candidate selection adds on checkable answers, so
it must make mistakes. Seeded and single-threaded: the same command on the same machine gives the same weights.
Writes into a temporary folder and renames it into place at the end.

    python scripts/train_arith.py
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parents[1] / "src" / "hetforge" / "assets" / "arith-demo"
EOS = 10  # "\n"
PAD = 0


def problems(seed: int, n_test: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All pairs (a, b) with 0 <= a, b < 100, split by a seeded permutation into (train, test)."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    perm = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    test = sorted(pairs[i] for i in perm[:n_test])
    train = [pairs[i] for i in perm[n_test:]]
    return train, test


def encode_batch(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded byte ids ``a+b=c\\n`` and a mask that is 1 on the answer bytes (the loss targets)."""
    rows = [(f"{a}+{b}=".encode(), f"{a + b}\n".encode()) for a, b in pairs]
    width = max(len(p) + len(q) for p, q in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (p, q) in enumerate(rows):
        ids[i, : len(p) + len(q)] = torch.tensor(list(p + q))
        mask[i, len(p): len(p) + len(q)] = True
    return ids, mask


@torch.no_grad()
def greedy_accuracy(model, pairs: list[tuple[int, int]]) -> float:
    """Share of ``pairs`` whose greedy answer (up to the newline, at most 4 bytes) is the sum."""
    model.eval()
    ok = 0
    for a, b in pairs:
        ids = list(f"{a}+{b}=".encode())
        out = []
        for _ in range(4):
            nxt = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt == EOS:
                break
            out.append(nxt)
        ok += bytes(out).decode(errors="replace") == str(a + b)
    model.train()
    return ok / len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=176)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--test", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ASSETS)
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, test = problems(args.seed, args.test)
    cfg = LlamaConfig(vocab_size=128, hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=64, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=EOS, eos_token_id=EOS,
                      pad_token_id=PAD)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e3:.1f} k parameters; {len(train)} training problems, {len(test)} test problems")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    history = []
    model.train()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step /
                                                                                            args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, len(train), (args.batch,), generator=g).tolist()
        ids, mask = encode_batch([train[i] for i in idx])
        logits = model(input_ids=ids[:, :-1]).logits
        tgt = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), tgt.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 100 == 0 or step + 1 == args.steps:
            history.append({"step": step + 1, "loss": round(loss.item(), 4),
                            "seconds": round(time.perf_counter() - t0, 1)})
            print(f"step {step + 1:5d}  loss {loss.item():.3f}  {time.perf_counter() - t0:.0f} s", flush=True)
    seconds = time.perf_counter() - t0
    acc = greedy_accuracy(model, test)
    print(f"greedy accuracy on the {len(test)} test problems: {acc:.3f} ({seconds:.0f} s training)")
    record = {"task": "a+b= with 0 <= a, b < 100; answer bytes then a newline (the end-of-text token)",
              "seed": args.seed, "steps": args.steps, "batch": args.batch, "lr": args.lr, "threads": args.threads,
              "parameters": n_params, "train_seconds": round(seconds, 1), "history": history,
              "greedy_test_accuracy": round(acc, 4), "test": [list(p) for p in test]}
    save(model, args.out, record)


def save(model, out: Path, record: dict) -> None:
    """Write the HF folder (config + fp32 safetensors + training.json) to a temporary sibling, then swap it in."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config.to_json_file(str(tmp / "config.json"))
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "model.safetensors").chmod(0o644)
    (tmp / "training.json").write_text(json.dumps(record) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
