"""Train the shipped arithmetic demo model: two-number addition (``37+45=`` → ``82`` then a newline), the backward
task (``82-45=`` → ``37``), and the same model to verify an answer (``37+45=82?`` → ``Y``, ``37+45=81?`` → ``N``).

Reproduces ``src/hetforge/assets/arith-demo/``: a tiny Llama-style model over bytes (vocabulary 128 = ASCII,
no tokenizer file: hetforge's byte-level tokenizer is the identity on ASCII) whose end-of-text token is the
newline, so an answer stops by itself. Every pair ``a+b`` with ``0 <= a, b < 100`` is a problem; a seeded
permutation splits them: its first ``--test`` pairs are the test set (written to ``training.json`` and used by
``bench/selection.py``), the next ``--val`` the validation split (never trained on: the verifier's threshold is
chosen on it), the rest the training set.

Three kinds of examples share every batch: *generation* (``--batch``: ``a+b=`` → the sum and the newline; loss on
the answer bytes), *backward* (``--backward``: ``c-b=`` → ``a`` for training pairs ``(a, b)``, ``c = a + b``; so
the backward form of a validation or test pair is never trained on) and *verification* (``--batch``:
``a+b=c?`` → ``Y`` when ``c`` is the sum, else ``N``; loss on that one byte). Half the verification examples are right; the wrong ones are near misses of the sum
(±1, ±2, ±10, a dropped or an extra carry, swapped digits) and, from ``--own-from`` on, the model's own wrong
answers, sampled from it every ``--own-every`` steps, so the negatives follow the mistakes it makes.

After training, on the validation split: the model's candidates (its greedy answer and ``--val-samples``
samples at temperature 1) are scored by both verifiers and the threshold that best separates right from wrong
ones (Youden's J) is written to ``verifier.json`` with each verifier's validation figures: the declared
(``kind: rewrite``) one — re-derivation: the probability of the candidate after the swapped sum ``b+a=`` times,
with the backward task, that of ``a`` after ``c-b=`` — and the yes/no one (P(``Y``) after ``a+b=c?``). The
runtime reads that file (``hetforge.runtime.verify``). ``--verifier-only`` recomputes ``verifier.json`` for the
model already in ``--out`` without training.

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
from collections import deque
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parents[1] / "src" / "hetforge" / "assets" / "arith-demo"
EOS = 10  # "\n"
PAD = 0
SUFFIX, YES, NO = "?", "Y", "N"  # the verification template: "{prompt}{candidate}?" then Y or N


def problems(seed: int, n_test: int, n_val: int = 0) -> tuple[list, list, list]:
    """All pairs (a, b) with 0 <= a, b < 100, split by a seeded permutation into (train, validation, test); the
    test set is the permutation's first ``n_test`` pairs whatever ``n_val`` is."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    perm = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    test = sorted(pairs[i] for i in perm[:n_test])
    val = sorted(pairs[i] for i in perm[n_test:n_test + n_val])
    train = [pairs[i] for i in perm[n_test + n_val:]]
    return train, val, test


def encode_rows(rows: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded byte ids of ``prefix + target`` per row and a mask that is 1 on the target bytes (the loss)."""
    enc = [(p.encode(), q.encode()) for p, q in rows]
    width = max(len(p) + len(q) for p, q in enc)
    ids = torch.full((len(enc), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(enc), width), dtype=torch.bool)
    for i, (p, q) in enumerate(enc):
        ids[i, : len(p) + len(q)] = torch.tensor(list(p + q))
        mask[i, len(p): len(p) + len(q)] = True
    return ids, mask


def encode_batch(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Generation examples ``a+b=c\\n`` (loss on the answer bytes)."""
    return encode_rows([(f"{a}+{b}=", f"{a + b}\n") for a, b in pairs])


def near_miss(a: int, b: int, g: torch.Generator) -> int:
    """A wrong sum close to ``a + b``: ±1, ±2, ±10, a dropped or an extra carry, or the sum's digits swapped."""
    s = a + b
    opts = {s + 1, s - 1, s + 2, s - 2, s + 10, s - 10}
    if a % 10 + b % 10 >= 10:
        opts.add(s - 10)  # the carry dropped
    else:
        opts.add(s + 10)  # a carry added where there is none
    if s >= 10:
        opts.add(int(str(s)[::-1]))
    opts = sorted(o for o in opts if o >= 0 and o != s)
    return opts[int(torch.randint(0, len(opts), (1,), generator=g))]


@torch.no_grad()
def sample_answers(model, pairs: list[tuple[int, int]], temperature: float, g: torch.Generator,
                   max_new: int = 4) -> list[str]:
    """The model's answers (up to the newline, at most ``max_new`` bytes): greedy at temperature 0, else sampled;
    batched per prompt length (no padding needed)."""
    was = model.training
    model.eval()
    out: list[str] = [""] * len(pairs)
    groups: dict[int, list[int]] = {}
    for i, (a, b) in enumerate(pairs):
        groups.setdefault(len(f"{a}+{b}="), []).append(i)
    for idx in groups.values():
        ids = torch.tensor([list(f"{pairs[i][0]}+{pairs[i][1]}=".encode()) for i in idx])
        done = torch.zeros(len(idx), dtype=torch.bool)
        gen: list[list[int]] = [[] for _ in idx]
        for _ in range(max_new):
            logits = model(input_ids=ids).logits[:, -1].float()
            if temperature <= 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)[:, 0]
            for r, t in enumerate(nxt.tolist()):
                if not done[r]:
                    if t == EOS:
                        done[r] = True
                    else:
                        gen[r].append(t)
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        for r, i in enumerate(idx):
            out[i] = bytes(gen[r]).decode(errors="replace")
    model.train(was)
    return out


@torch.no_grad()
def p_yes(model, rows: list[tuple[int, int, str]], batch: int = 512) -> list[float]:
    """The verifier's score of each ``(a, b, candidate)``: P(``Y``) after ``a+b=candidate?`` (full softmax)."""
    was = model.training
    model.eval()
    out: list[float] = []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        texts = [f"{a}+{b}={c}{SUFFIX}".encode() for a, b, c in chunk]
        width = max(len(t) for t in texts)
        ids = torch.full((len(texts), width), PAD, dtype=torch.long)
        for r, t in enumerate(texts):
            ids[r, : len(t)] = torch.tensor(list(t))
        last = torch.tensor([len(t) - 1 for t in texts])
        logits = model(input_ids=ids).logits[torch.arange(len(texts)), last].float()
        out += torch.softmax(logits, -1)[:, ord(YES)].tolist()
    model.train(was)
    return out


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


def verify_rows(train, idx: list[int], own: deque, g: torch.Generator) -> list[tuple[str, str]]:
    """Verification examples for the training pairs ``idx``: the first half right (``Y``), the rest wrong (``N``):
    every other wrong one from the pool of the model's own wrong answers when it has any, else a near miss."""
    rows = []
    half = len(idx) // 2
    for j, i in enumerate(idx):
        a, b = train[i]
        if j < half:
            rows.append((f"{a}+{b}={a + b}{SUFFIX}", YES))
        elif own and j % 2:
            a, b, c = own[int(torch.randint(0, len(own), (1,), generator=g))]
            rows.append((f"{a}+{b}={c}{SUFFIX}", NO))
        else:
            rows.append((f"{a}+{b}={near_miss(a, b, g)}{SUFFIX}", NO))
    return rows


def youden(scores: list[float], right: list[bool]) -> tuple[float, dict]:
    """The threshold on P(yes) that maximises TPR − FPR (right candidates kept, wrong ones dropped), the ROC AUC
    and the rates at that threshold."""
    pos = sorted(s for s, r in zip(scores, right, strict=True) if r)
    neg = sorted(s for s, r in zip(scores, right, strict=True) if not r)
    best, thr = -1.0, 0.5
    for t in sorted(set(scores)):
        tpr = sum(s >= t for s in pos) / max(1, len(pos))
        fpr = sum(s >= t for s in neg) / max(1, len(neg))
        if tpr - fpr > best:
            best, thr = tpr - fpr, t
    auc = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / max(1, len(pos) * len(neg))
    return thr, {"auc": round(auc, 4), "right": len(pos), "wrong": len(neg),
                 "kept_right": round(sum(s >= thr for s in pos) / max(1, len(pos)), 4),
                 "kept_wrong": round(sum(s >= thr for s in neg) / max(1, len(neg)), 4)}


def validation_candidates(model, val: list[tuple[int, int]], samples: int, seed: int) -> list[list[str]]:
    """Each validation problem's distinct candidates: the greedy answer first, then ``samples`` at temperature 1."""
    g = torch.Generator().manual_seed(seed + 1)
    cands = [[c] for c in sample_answers(model, val, 0.0, g)]
    for _ in range(samples):
        for lst, c in zip(cands, sample_answers(model, val, 1.0, g), strict=True):
            if c not in lst:
                lst.append(c)
    return cands


@torch.no_grad()
def seq_logp(model, rows: list[tuple[str, str]], batch: int = 512) -> list[float]:
    """log P(answer bytes + the newline | prompt) for each ``(prompt, answer)`` (full softmax, temperature 1)."""
    was = model.training
    model.eval()
    out: list[float] = []
    for i in range(0, len(rows), batch):
        ids, mask = encode_rows([(p, f"{c}\n") for p, c in rows[i:i + batch]])
        logp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits.float(), -1)
        tok = logp.gather(-1, ids[:, 1:, None])[..., 0]
        out += (tok * mask[:, 1:]).sum(-1).tolist()
    model.train(was)
    return out


def validate_rewrite(model, val: list[tuple[int, int]], cands: list[list[str]], checks: list[dict]) -> dict:
    """The re-derivation verifier on the validation split: each candidate ``c`` of ``a+b=`` scored by the product
    over ``checks`` of P(expected answer + newline | check prompt) (e.g. ``c`` after the swapped prompt ``b+a=``;
    ``a`` after ``c-b=``); the threshold on that score (Youden's J) and what ranking by it times P(c | a+b=) (the
    runtime's best-of) would choose."""
    rows = [(a, b, c) for (a, b), lst in zip(val, cands, strict=True) for c in lst]
    fwd = seq_logp(model, [(f"{a}+{b}=", c) for a, b, c in rows])
    chk = [0.0] * len(rows)
    for ch in checks:
        fields = [{"a": str(a), "b": str(b), "candidate": c} for a, b, c in rows]
        got = seq_logp(model, [(ch["prompt"].format(**f), ch.get("expect", "{candidate}").format(**f))
                               for f in fields])
        chk = [x + y for x, y in zip(chk, got, strict=True)]
    right = [c == str(a + b) for a, b, c in rows]
    thr, fig = youden([math.exp(x) for x in chk], right)
    top, greedy_swapped, i = [], 0, 0
    for lst in cands:
        n = len(lst)
        k = max(range(n), key=lambda j: (fwd[i + j] + chk[i + j], -j))
        top.append(right[i + k])
        i += n
    g = torch.Generator().manual_seed(0)
    for (a, b), c in zip(val, sample_answers(model, [(b, a) for a, b in val], 0.0, g), strict=True):
        greedy_swapped += c == str(a + b)
    ga = [lst[0] == str(a + b) for (a, b), lst in zip(val, cands, strict=True)]
    fig.update({"problems": len(val), "candidates_per_problem": round(len(rows) / len(val), 2),
                "greedy_pass_at_1": round(sum(ga) / len(val), 4),
                "greedy_swapped_pass_at_1": round(greedy_swapped / len(val), 4),
                "rewrite_best_pass_at_1": round(sum(top) / len(val), 4),
                "oracle": round(sum(any(c == str(a + b) for c in lst) for (a, b), lst in zip(val, cands, strict=True))
                                / len(val), 4)})
    return {"threshold": round(thr, 6), "validation": fig}


def rewrite_checks(backward: bool) -> list[dict]:
    """The re-derivation checks of the declared verifier: the candidate after the swapped sum ``b+a=``, and with a
    model trained on the backward task also ``a`` after ``c-b=`` (``c`` the candidate)."""
    out = [{"prompt": "{b}+{a}=", "expect": "{candidate}"}]
    if backward:
        out.append({"prompt": "{candidate}-{b}=", "expect": "{a}"})
    return out


def verifier_entry(model, val: list[tuple[int, int]], samples: int, seed: int, backward: bool = False) -> dict:
    """``verifier.json``: the declared (auto) verifier — re-derivation under equivalent prompts — with its
    threshold and validation figures, and the yes/no verifier the model was also trained for
    (``--verifier yesno``)."""
    cands = validation_candidates(model, val, samples, seed)
    ver = validate(model, val, cands)
    checks = rewrite_checks(backward)
    rew = validate_rewrite(model, val, cands, checks)
    on = (f"validation split ({len(val)} problems, never trained on; Youden's J over the model's greedy answer and "
          f"{samples} samples at temperature 1)")
    print(f"verifiers on the {len(val)} validation problems: yes/no {ver}; rewrite {rew}")
    return {"kind": "rewrite", "match": r"^(?P<a>\d+)\+(?P<b>\d+)=$", "checks": checks,
            "threshold": rew["threshold"], "threshold_chosen_on": on, "validation": rew["validation"],
            "yes_no": {"template": "{prompt}{candidate}" + SUFFIX, "suffix": SUFFIX, "yes": YES, "no": NO,
                       "threshold": ver["threshold"], "threshold_chosen_on": on, "validation": ver["validation"]},
            "trained_by": "scripts/train_arith.py"}


def validate(model, val: list[tuple[int, int]], cands: list[list[str]]) -> dict:
    """The yes/no verifier on the validation split: each problem's distinct candidates scored by P(yes); the
    threshold (Youden's J) and what ranking by P(yes) would choose."""
    rows = [(a, b, c) for (a, b), lst in zip(val, cands, strict=True) for c in lst]
    scores = p_yes(model, rows)
    right = [c == str(a + b) for a, b, c in rows]
    thr, fig = youden(scores, right)
    by: dict[tuple[int, int], list[tuple[float, bool, int]]] = {}
    for (a, b, _c), s, r in zip(rows, scores, right, strict=True):
        by.setdefault((a, b), []).append((s, r, len(by.get((a, b), []))))
    top = [max(v, key=lambda x: (x[0], -x[2]))[1] for v in by.values()]
    fig.update({"problems": len(val), "candidates_per_problem": round(len(rows) / len(val), 2),
                "greedy_pass_at_1": round(sum(v[0][1] for v in by.values()) / len(val), 4),
                "verifier_best_pass_at_1": round(sum(top) / len(val), 4),
                "oracle": round(sum(any(x[1] for x in v) for v in by.values()) / len(val), 4)})
    return {"threshold": round(thr, 6), "validation": fig}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3600)
    ap.add_argument("--batch", type=int, default=128, help="generation examples per step (and as many "
                                                           "verification examples)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=176)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--test", type=int, default=400)
    ap.add_argument("--val", type=int, default=400)
    ap.add_argument("--own-from", type=int, default=100, help="first step that samples the model's own answers")
    ap.add_argument("--own-every", type=int, default=20)
    ap.add_argument("--own-pool", type=int, default=2048)
    ap.add_argument("--val-samples", type=int, default=8)
    ap.add_argument("--verify-weight", type=float, default=1.0, help="loss weight of a verification byte "
                                                                     "(a generation byte weighs 1)")
    ap.add_argument("--backward", type=int, default=128, help="backward examples per step: c-b= -> a for training "
                                                           "pairs (a, b), c = a + b (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ASSETS)
    ap.add_argument("--verifier-only", action="store_true", help="no training: recompute verifier.json of the model "
                                                                 "already in --out (its training.json splits)")
    args = ap.parse_args()
    if args.verifier_only:
        rewrite_verifier_json(args)
        return

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, val, test = problems(args.seed, args.test, args.val)
    cfg = LlamaConfig(vocab_size=128, hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=64, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=EOS, eos_token_id=EOS,
                      pad_token_id=PAD)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e3:.1f} k parameters; {len(train)} training, {len(val)} validation, {len(test)} "
          "test problems")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    history = []
    own: deque = deque(maxlen=args.own_pool)  # (a, b, wrong answer) the model gave
    model.train()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step /
                                                                                            args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        if step >= args.own_from and step % args.own_every == 0:
            idx = torch.randint(0, len(train), (args.batch,), generator=g).tolist()
            pick = [train[i] for i in idx]
            for temp in (0.0, 1.0):
                for (a, b), c in zip(pick, sample_answers(model, pick, temp, g), strict=True):
                    if c != str(a + b) and c.isdigit():
                        own.append((a, b, c))
        idx = torch.randint(0, len(train), (args.batch,), generator=g).tolist()
        vidx = torch.randint(0, len(train), (args.batch,), generator=g).tolist()
        rows = [(f"{train[i][0]}+{train[i][1]}=", f"{sum(train[i])}\n") for i in idx]
        back = []
        if args.backward:
            bidx = torch.randint(0, len(train), (args.backward,), generator=g).tolist()
            back = [(f"{sum(train[i])}-{train[i][1]}=", f"{train[i][0]}\n") for i in bidx]
        rows = rows + back
        ids, mask = encode_rows(rows + verify_rows(train, vidx, own, g))
        logits = model(input_ids=ids[:, :-1]).logits
        tgt = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
        per = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), tgt.reshape(-1), ignore_index=-100,
                                                reduction="none").reshape(tgt.shape)
        w = mask[:, 1:].float()
        w[len(rows):] *= args.verify_weight
        loss = (per * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 100 == 0 or step + 1 == args.steps:
            history.append({"step": step + 1, "loss": round(loss.item(), 4), "own_negatives": len(own),
                            "seconds": round(time.perf_counter() - t0, 1)})
            print(f"step {step + 1:5d}  loss {loss.item():.3f}  own negatives {len(own)}  "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    seconds = time.perf_counter() - t0
    acc = greedy_accuracy(model, test)
    print(f"greedy accuracy on the {len(test)} test problems: {acc:.3f} ({seconds:.0f} s training)")
    verifier = verifier_entry(model, val, args.val_samples, args.seed, args.backward > 0)
    record = {"task": "a+b= with 0 <= a, b < 100; answer bytes then a newline (the end-of-text token); "
                      "backward c-b= then a (training pairs only); verification a+b=c? then Y or N",
              "seed": args.seed, "steps": args.steps, "batch": args.batch, "lr": args.lr, "threads": args.threads,
              "verify_weight": args.verify_weight, "backward": args.backward, "own_from": args.own_from,
              "own_every": args.own_every,
              "parameters": n_params, "train_seconds": round(seconds, 1), "history": history,
              "greedy_test_accuracy": round(acc, 4), "splits": {"train": len(train), "validation": len(val),
                                                                "test": len(test)},
              "test": [list(p) for p in test], "validation": [list(p) for p in val]}
    save(model, args.out, record, verifier)


def rewrite_verifier_json(args) -> None:
    """Recompute ``verifier.json`` of the model in ``args.out`` (no training; the validation split of its
    ``training.json``), single-threaded."""
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    model = LlamaForCausalLM.from_pretrained(str(args.out)).eval()
    rec = json.loads((args.out / "training.json").read_text())
    val = [tuple(p) for p in rec["validation"]]
    entry = verifier_entry(model, val, args.val_samples, args.seed, rec.get("backward", 0) > 0)
    (args.out / "verifier.json").write_text(json.dumps(entry, indent=1) + "\n")
    print(f"wrote {args.out / 'verifier.json'}")


def save(model, out: Path, record: dict, verifier: dict) -> None:
    """Write the HF folder (config + fp32 safetensors + training.json + verifier.json) to a temporary sibling, then
    swap it in."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config.to_json_file(str(tmp / "config.json"))
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "model.safetensors").chmod(0o644)
    (tmp / "training.json").write_text(json.dumps(record) + "\n")
    (tmp / "verifier.json").write_text(json.dumps(verifier, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
