import math

import torch
import torch.nn.functional as F

from conftest import tiny_llama
from draftlab.drafters import build_draft
from draftlab.losses import draft_losses, head_loss


def test_medusa_shapes_and_identity_init():
    base = tiny_llama()
    heads = build_draft({"type": "medusa", "num_heads": 3, "num_layers": 2}, base).double()
    h = torch.randn(2, 5, 32, dtype=torch.float64)
    feats = heads.train_hidden(h, None)
    assert len(feats) == 3 and all(f.shape == (2, 5, 32) for f in feats)
    logits = heads.logits(h)
    assert logits.shape == (2, 5, 3, 64)
    # Zero-initialised residual blocks + the base's lm_head: every fresh head equals the base's logits.
    base_logits = base.lm_head(h)
    for k in range(3):
        torch.testing.assert_close(logits[..., k, :], base_logits)


def test_head_loss_matches_direct_cross_entropy_and_is_chunk_invariant():
    torch.manual_seed(0)
    h, w = torch.randn(37, 8), torch.randn(11, 8)
    t = torch.randint(0, 11, (37,))
    direct = F.cross_entropy(h @ w.t(), t, reduction="sum")
    for chunk in (1, 5, 37, 100):
        loss, top1, topk, _ = head_loss(h, w, t, chunk_size=chunk, topk=3)
        torch.testing.assert_close(loss, direct)
    logits = h @ w.t()
    assert top1.item() == (logits.argmax(-1) == t).sum().item()
    assert topk.item() == (logits.topk(3).indices == t[:, None]).any(-1).sum().item()


def test_chunked_loss_gradients_equal_unchunked():
    torch.manual_seed(0)
    h = torch.randn(20, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    t = torch.randint(0, 11, (20,))
    head_loss(h, w, t, chunk_size=3)[0].backward()
    g1 = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    F.cross_entropy(h @ w.t(), t, reduction="sum").backward()
    torch.testing.assert_close(g1[0], h.grad)
    torch.testing.assert_close(g1[1], w.grad)


def test_distillation_is_soft_cross_entropy_to_the_teacher():
    torch.manual_seed(0)
    h, w = torch.randn(6, 4), torch.randn(5, 4)
    th, tw = torch.randn(6, 4), torch.randn(5, 4)
    t = torch.randint(0, 5, (6,))
    p = torch.softmax(th @ tw.t(), -1)
    logq = torch.log_softmax(h @ w.t(), -1)
    soft = -(p * logq).sum()
    hard = F.nll_loss(logq, t, reduction="sum")
    torch.testing.assert_close(head_loss(h, w, t, th, tw, distill_weight=1.0, chunk_size=4)[0], soft)
    torch.testing.assert_close(head_loss(h, w, t, th, tw, distill_weight=0.25, chunk_size=4)[0], 0.75 * hard + 0.25 * soft)


def test_draft_losses_alignment_and_decay_on_hand_made_tensors():
    # Two heads, vocab 3, identity lm_heads: head k's feature at position t are the logits for token t+k+2.
    ids = torch.tensor([[0, 1, 2, 0, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    big = 20.0
    f0 = torch.zeros(1, 5, 3)
    f1 = torch.zeros(1, 5, 3)
    for t in range(3):  # head 0 predicts ids[t+2] perfectly
        f0[0, t, ids[0, t + 2]] = big
    eye = torch.eye(3)
    out = draft_losses([f0, f1], [eye, eye], ids, mask, head_decay=0.5, topk=1)
    # head 0: 3 positions (targets at 2,3,4), ~zero loss; head 1: 2 positions, uniform logits -> log 3 each.
    assert out["count"].tolist() == [3.0, 2.0]
    assert out["top1"][0].item() == 3.0
    expected = 0.5 * math.log(3)
    assert abs(out["loss"].item() - expected) < 1e-6


def test_a_head_with_nothing_to_supervise_still_backpropagates():
    """A micro-batch whose answer tokens were cut by max_len: zero loss, but a graph to every head's parameters."""
    h, h1 = torch.randn(1, 4, 8, requires_grad=True), torch.randn(1, 4, 8, requires_grad=True)
    w, w1 = torch.randn(11, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    ids = torch.randint(0, 11, (1, 4))
    out = draft_losses([h, h1], [w, w1], ids, torch.tensor([[0, 0, 1, 0]]))  # head 0 (t+2) sees position 2, head 1 none
    out["loss"].backward()
    # Head 1 has its own parameters here, so its (zero) gradient exists only if its loss joined the graph.
    assert out["count"].tolist() == [1.0, 0.0] and w1.grad is not None and h1.grad is not None
    assert torch.count_nonzero(w1.grad) == 0 and torch.count_nonzero(w.grad) > 0
    h.grad = w.grad = None
    out = draft_losses([h], [w], ids, torch.zeros(1, 4, dtype=torch.long))
    assert out["loss"].item() == 0.0
    out["loss"].backward()
    assert torch.count_nonzero(w.grad) == 0 and h.grad is not None


def test_every_rank_runs_as_many_objective_forwards_in_evaluation():
    """Under ZeRO-3 each forward of the draft objective gathers its partitioned parameters (a collective). With
    held-out examples that do not split evenly, ranks that ran out skipped the objective (found by review: 100
    examples on 8 ranks, batch 4, four ranks ran 4 forwards and four ran 3: the first evaluation hung). A rank that
    ran out now joins with a stand-in example whose figures it drops."""
    from types import SimpleNamespace

    from draftlab.config import LossSection
    from draftlab.train.objectives import DraftObjective, evaluate

    base = tiny_llama(seed=4, dtype=torch.float32)
    draft = build_draft({"type": "medusa", "num_heads": 2, "num_layers": 1}, base).float()
    obj = DraftObjective(draft, LossSection())
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(3, 64, (6,), generator=g).tolist(), "loss_mask": [0, 0, 1, 1, 1, 1]}
                for _ in range(13)]
    calls = []
    obj.register_forward_hook(lambda *a: calls.append(1))
    w = base.get_output_embeddings().weight

    def on_rank(rank, world):
        acc = SimpleNamespace(process_index=rank, num_processes=world, device=torch.device("cpu"),
                              autocast=lambda: torch.autocast("cpu", enabled=False), reduce=lambda t, reduction: t)
        calls.clear()
        rec = evaluate(obj, base, examples, 3, 0, acc, w, draft)
        return len(calls), rec["eval_positions"]

    runs = [on_rank(r, 4) for r in range(4)]  # 4, 3, 3, 3 examples: batches of 3 make 2, 1, 1, 1 of them
    assert [n for n, _ in runs] == [2, 2, 2, 2]
    alone = on_rank(0, 1)[1]  # the stand-ins' positions are not counted: the ranks' sums are one rank's figures
    assert [sum(p[k] for _, p in runs) for k in range(2)] == alone
