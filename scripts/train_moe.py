"""Train the shipped MoE demo model (``moe-demo``) on the demo model's corpus, so that its routing is learned.

A small Mixtral-style model (8 experts, top-2, RMSNorm, rotary, GQA 4/2, tied embeddings) trained on the same
text and the same train/validation split as ``scripts/train_demo.py`` (CPython's ``pydoc_data.topics``), with
the demo model's byte-level BPE tokenizer (read from ``hetforge/assets/demo``). The router is trained with
Mixtral's load-balancing loss (``--aux-coef``). Seeded and single-threaded, so the same command on the same
machine gives the same weights; the checkpoint with the lowest validation loss is kept; written to a temporary
folder and renamed into place (``hetforge/assets/moe-demo``: config, fp16 safetensors, tokenizer, record).

    python scripts/train_moe.py            # ~4 minutes on one core
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch

from hetforge.models.demo import ASSETS as DEMO_ASSETS
from hetforge.models.demo import EOT, corpus, split_text

OUT = Path(__file__).resolve().parents[1] / "src" / "hetforge" / "assets" / "moe-demo"


def encode(tok, text: str) -> torch.Tensor:
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for i, doc in enumerate(text.split(EOT)):
        if i:
            ids.append(eot)
        ids.extend(tok.encode(doc).ids)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int, max_windows: int = 32) -> float:
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq)
    losses = []
    for i in range(n):
        chunk = data[i * seq: i * seq + seq + 1]
        logits = model(input_ids=chunk[None, :-1]).logits[0]
        losses.append(torch.nn.functional.cross_entropy(logits, chunk[1:]).item())
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--expert-ffn", type=int, default=192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    from tokenizers import Tokenizer
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    names, text = corpus()
    train_text, val_text, cut = split_text(text, args.val_frac)
    tok = Tokenizer.from_file(str(DEMO_ASSETS / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    train_ids, val_ids = encode(tok, train_text), encode(tok, val_text)
    print(f"train {len(train_ids)} tokens, val {len(val_ids)} tokens, vocab {vocab}")
    cfg = MixtralConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.expert_ffn, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, router_aux_loss_coef=args.aux_coef, output_router_logits=True,
        tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    model = MixtralForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e6:.2f} M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    g = torch.Generator().manual_seed(args.seed)
    best = (float("inf"), -1, None)
    history = []
    t0 = time.perf_counter()
    train_loss = float("nan")
    model.train()
    for step in range(args.steps):
        w = min(1.0, (step + 1) / args.warmup)
        p = max(0.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        for group in opt.param_groups:
            group["lr"] = args.lr * w * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        starts = torch.randint(0, len(train_ids) - args.seq - 1, (args.batch,), generator=g)
        batch = torch.stack([train_ids[s: s + args.seq + 1] for s in starts.tolist()])
        out = model(input_ids=batch, labels=batch)
        # HF shifts the labels itself; the aux (load-balancing) loss is added when output_router_logits is on
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_loss = 0.9 * train_loss + 0.1 * loss.item() if step else loss.item()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val = evaluate(model, val_ids, args.seq)
            history.append({"step": step + 1, "train_loss": round(train_loss, 4), "val_loss": round(val, 4),
                            "seconds": round(time.perf_counter() - t0, 1)})
            print(f"step {step + 1:5d}  train {train_loss:.3f}  val {val:.3f}  {time.perf_counter() - t0:.0f} s",
                  flush=True)
            if val < best[0]:
                best = (val, step + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
    seconds = time.perf_counter() - t0
    model.load_state_dict(best[2])
    print(f"best step {best[1]}: val loss {best[0]:.3f} (val perplexity {math.exp(best[0]):.1f}); {seconds:.0f} s")
    record = {"seed": args.seed, "steps": args.steps, "best_step": best[1], "batch": args.batch, "seq": args.seq,
              "lr": args.lr, "aux_coef": args.aux_coef, "threads": args.threads, "parameters": n_params,
              "train_seconds": round(seconds, 1), "final_val_loss": round(best[0], 4), "history": history,
              "split": {"source": "pydoc_data.topics (same text and split as scripts/train_demo.py)",
                        "val_start_char": cut, "val_frac": args.val_frac, "train_tokens": len(train_ids),
                        "val_tokens": len(val_ids)},
              "tokenizer": "hetforge/assets/demo/tokenizer.json"}
    save(model, args.out, record)


def save(model, out: Path, record: dict) -> None:
    """Write the HF folder (fp16 weights, tokenizer copied from the demo model) to a temporary sibling, then swap."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = model.config
    cfg.output_router_logits = False
    cfg.dtype = "float16"
    cfg.to_json_file(str(tmp / "config.json"))
    sd = {k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "model.safetensors").chmod(0o644)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_ASSETS / f, tmp / f)
    (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
