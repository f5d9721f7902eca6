"""Models a user may bring, written the way real code is written (hunt models8): a RealNVP
flow with an ``inverse`` method, a capsule network's bare ``W``, PointNet with BatchNorm
statistics from earlier training."""
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import precondfx


# -- (a) a RealNVP flow: forward and inverse --------------------------------------------------
class Coupling(nn.Module):
    def __init__(self, d: int, mask: torch.Tensor):
        super().__init__()
        self.register_buffer("mask", mask)
        self.s = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, d), nn.Tanh())
        self.t = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, d))

    def forward(self, x):
        xm = x * self.mask
        s = self.s(xm) * (1 - self.mask)
        t = self.t(xm) * (1 - self.mask)
        return xm + (1 - self.mask) * (x * torch.exp(s) + t)

    def inverse(self, y):
        ym = y * self.mask
        s = self.s(ym) * (1 - self.mask)
        t = self.t(ym) * (1 - self.mask)
        return ym + (1 - self.mask) * (y - t) * torch.exp(-s)


class RealNVP(nn.Module):
    def __init__(self, d: int = 4, n: int = 4):
        super().__init__()
        masks = [torch.tensor([i % 2, (i + 1) % 2] * (d // 2)).float() for i in range(n)]
        self.layers = nn.ModuleList(Coupling(d, m) for m in masks)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def inverse(self, z):
        for layer in reversed(self.layers):
            z = layer.inverse(z)
        return z

    def sample(self, n: int):
        return self.inverse(torch.randn(n, 4))


def _precondition_caught(model, x, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, rep = precondfx.precondition(model, x, **kw)
    return out, rep, [str(w.message) for w in caught if "precondfx" in str(w.message)]


def test_flow_inverse_without_forward_constants_is_said_with_the_remedy():
    """Before: inverse(forward(x)) was 32.5 off x (max abs) on the default result, and nothing
    but a line of the report said it; the result's forward carries residual scales at the
    couplings' adds and the output scale, which the user's inverse cannot apply.  Now a
    RuntimeWarning names the methods (inverse, sample) and the options that keep them exact,
    and with those options inverse(forward(x)) recovers x."""
    torch.manual_seed(0)
    model, x = RealNVP(), torch.randn(64, 4)
    res, rep, said = _precondition_caught(model, x)
    assert isinstance(res, RealNVP)
    assert (res.inverse(res(x)) - x).abs().max() > 1e-2      # the forward-only constants
    assert len(said) == 1 and "RealNVP.inverse" in said[0] and ".sample" in said[0], said
    assert "target_std=None" in said[0] and "residual='none'" in said[0]
    res2, rep2, said2 = _precondition_caught(model, x, target_std=None, residual="none")
    assert said2 == [] and rep2.result["forward_only"] == []
    assert (res2.inverse(res2(x)) - x).abs().max() < 1e-3


def test_method_through_self_call_is_not_warned():
    """A method that runs the model through ``self(x)`` runs the rewritten graph: no warning."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return x + self.b(F.relu(self.a(x)))

        def predict(self, x):
            return self(x).argmax(-1)

    torch.manual_seed(0)
    _, rep, said = _precondition_caught(Net(), torch.randn(32, 8))
    assert rep.result["forward_only"] and said == []


# -- (c) a capsule network's bare W -----------------------------------------------------------
def _squash(s, dim=-1):
    n2 = (s ** 2).sum(dim, keepdim=True)
    return n2 / (1 + n2) * s / torch.sqrt(n2 + 1e-8)


class CapsNet(nn.Module):
    def __init__(self, n_in=8, d_in=4, n_out=4, d_out=6, iters=2):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 5)
        self.prim = nn.Conv2d(16, n_in * d_in, 5, stride=2)
        self.n_in, self.d_in, self.iters = n_in, d_in, iters
        self.W = nn.Parameter(0.01 * torch.randn(1, n_in, n_out, d_out, d_in))

    def forward(self, x):
        u = self.prim(F.relu(self.conv(x)))
        u = _squash(u.view(u.shape[0], self.n_in, self.d_in, -1).mean(-1))
        u_hat = (self.W @ u[:, :, None, :, None]).squeeze(-1)
        b = torch.zeros(u.shape[0], self.n_in, u_hat.shape[2])
        for _ in range(self.iters):
            v = _squash((b.softmax(2)[..., None] * u_hat).sum(1))
            b = b + (u_hat * v[:, None]).sum(-1)
        return v.norm(dim=-1)


def test_capsule_report_names_the_bare_parameter_it_redraws():
    """Before: W's std went 0.01 -> 0.42 and the table's row said only 'matmul ... geometric
    std=0.42' (W appeared in no line saying it was re-drawn).  Now the row and the parameters
    line name W."""
    torch.manual_seed(0)
    model = CapsNet()
    res, rep = precondfx.precondition(model, torch.randn(4, 1, 16, 16), balance="analytic",
                                      lr=None, capture=("export",))
    assert abs(res.W.std().item() - model.W.std().item()) > 0.05     # re-drawn
    text = rep.table(width=200)
    row = [ln for ln in text.splitlines() if ln.startswith("matmul ")]
    assert len(row) == 1 and "W geometric std=" in row[0], row
    assert "re-initialized parameters used outside a module: W (row matmul)" in text


# -- (d) PointNet: BatchNorm statistics and eval mode -----------------------------------------
class PointNet(nn.Module):
    def __init__(self, k: int = 10):
        super().__init__()
        self.stn_bn = nn.BatchNorm1d(3)        # on the raw points: upstream of every re-draw
        self.mlp1 = nn.Sequential(nn.Conv1d(3, 32, 1), nn.BatchNorm1d(32), nn.ReLU(),
                                  nn.Conv1d(32, 64, 1), nn.BatchNorm1d(64), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                  nn.Linear(32, k))

    def forward(self, pts):
        h = self.mlp1(self.stn_bn(pts.transpose(1, 2)))
        return self.head(torch.max(h, dim=2)[0])


def test_pointnet_trained_statistics_of_redrawn_layers_are_reset():
    """A PointNet whose BatchNorm layers tracked batches (trained, or warmed up): before, the
    re-drawn convolutions kept the old weights' running statistics, and the result's eval-mode
    output std was 23.5 (the model's own 0.39, the train-mode calibrated 1.0).  Now the
    statistics after re-drawn weights are reset to a new model's (eval std 1.86, as a freshly
    built model's: the docs' calibration section), the input BatchNorm's kept (nothing
    upstream of it changed), the user's model untouched, and the report says which."""
    torch.manual_seed(0)
    model, x = PointNet(), torch.randn(16, 50, 3) * 2 + 1
    with torch.no_grad():
        for _ in range(30):
            model(x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res, rep = precondfx.precondition(model, x, balance="analytic", lr=None)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for path in ("mlp1.1", "mlp1.4", "head.1"):
        bn = res.get_submodule(path)
        assert int(bn.num_batches_tracked) == 0 and torch.all(bn.running_var == 1), path
    assert torch.equal(res.stn_bn.running_mean, model.stn_bn.running_mean)
    assert int(res.stn_bn.num_batches_tracked) == 30
    res.eval()
    with torch.no_grad():
        std = res(x).std().item()
    assert std < 5, std
    assert "mlp1.1, mlp1.4, head.1" in rep.table(width=200)



# -- (b) fold: an Euler-integration loop reusing one block -------------------------------------
class Euler(nn.Module):
    def __init__(self, d: int = 16, steps: int = 4):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.f = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, d))
        self.head = nn.Linear(d, 3)
        self.steps = steps

    def forward(self, x):
        h = self.inp(x)
        dt = 1.0 / self.steps
        for _ in range(self.steps):
            h = h + dt * self.f(h)
        return self.head(h)


def test_euler_loop_with_one_shared_block_folds_exactly():
    """Before: fold refused the four residual scales (0.5 at every step) on the output of the
    one block called at each step ('no module of your class can absorb exactly').  They are
    the same at every call, so the block's last layer carries them: now fold gives the user's
    class computing the same function (max abs difference 3.6e-7).  A schedule that differs
    per step ('nf') is still refused, saying the calls' scales differ."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    res, _ = precondfx.precondition(Euler(), x, balance="analytic", lr=None)
    folded = precondfx.fold(res)
    assert type(folded) is Euler
    with torch.no_grad():
        assert (folded(x) - res(x)).abs().max() < 1e-5
    res2, _ = precondfx.precondition(Euler(), x, balance="analytic", lr=None,
                                     residual_scale="nf")
    try:
        precondfx.fold(res2)
    except precondfx.PrecondError as e:
        assert "module f.2 is called 4 times with different output scales" in str(e), str(e)
    else:
        raise AssertionError("fold of per-step scales on one shared block was not refused")


# -- a triplet net: one encoder, three returned embeddings ------------------------------------
class Triplet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, anchor, positive, negative):
        return self.enc(anchor), self.enc(positive), self.enc(negative)


def test_triplet_net_embeds_all_three_inputs_with_the_same_function():
    """A triplet net returning its one encoder's three embeddings (trained with
    F.triplet_margin_loss outside): before, the output scale went on the first returned value
    only, so the same input was embedded with std 1.004 as anchor and 1.427 as positive or
    negative (the loss compared two functions).  Now every value returned from the encoder's
    calls takes the scale, on the fx and the eager back end."""
    torch.manual_seed(0)
    a = torch.randn(16, 10)
    for capture in (("fx",), ("eager",)):
        res, _ = precondfx.precondition(Triplet(), (a, a.clone(), a.clone()),
                                        balance="analytic", lr=None, capture=capture)
        with torch.no_grad():
            za, zp, zn = res(a, a, a)
        assert abs(za.std().item() - 1) < 0.05, capture
        assert torch.allclose(za, zp) and torch.allclose(za, zn), (capture, zp.std().item())


# -- weight tying written as a product with the embedding's weight -----------------------------
class TiedLM(nn.Module):
    def __init__(self, v: int = 50, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d),
                                                  nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(2))
        self.ln = nn.LayerNorm(d)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.ln(h) @ self.emb.weight.t()


def test_tied_output_product_folds_into_the_final_norm():
    """``logits = self.ln(h) @ self.emb.weight.t()`` (the tied output of many small LMs):
    before, fold refused the output scale ('multiplies the output of matmul ..., which no
    module of your class can absorb exactly'); the product is linear in ln's output, so ln's
    weight and bias carry it: now fold gives the user's class, same logits (max abs diff
    6e-7), the embedding untouched by it."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (8, 12))
    res, rep = precondfx.precondition(TiedLM(), ids, lr=None, balance="analytic")
    assert abs(rep.output_scale - 1) > 0.05             # the test needs a real output scale
    folded = precondfx.fold(res)
    assert type(folded) is TiedLM
    with torch.no_grad():
        ref = res(ids)
        assert (folded(ids) - ref).abs().max() < 1e-4 * ref.abs().max()
        assert torch.equal(folded.emb.weight, res.emb.weight)
