"""cupy_symbuf.moe.autograd: differentiable dispatch / combine for PyTorch tensors, forward values and gradients
against a NumPy computation of the same layer on the gathered inputs of every rank."""
import numpy as np
import pytest

import cupy_symbuf as cs
from _util import rng_for

torch = pytest.importorskip("torch")
from cupy_symbuf.moe import autograd  # noqa: E402


def _routing(rng, T, K, E):
    """topk_idx [T, K]: distinct experts per token, some slots -1 (and one token sent nowhere)."""
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    idx[rng.random((T, K)) < 0.2] = -1
    if T:
        idx[0] = -1
    return idx


def _device(backend):
    return "cpu" if backend == "host" else "cuda"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dispatch_combine_gradients_match_numpy(backend, comm, dtype):
    """Layer: recv = dispatch(x, w); z = recv * (rank + 1) * sum_k recv_w; y = combine(z); loss = sum(y * g).
    NumPy: y[t] = sum over destination ranks r of (r + 1) * x[t] * (sum of t's weights whose expert is on r);
    grad_x[t] = the same with g[t]; grad_w[t, k] = (r_k + 1) * <x[t], g[t]> for live slots, 0 else."""
    W, rank = comm.size, comm.rank
    T, H, K = 9, 16, 3
    E = 4 * W
    L = E // W
    rng = rng_for(comm, 41)
    x = rng.standard_normal((T, H)).astype(np.float32)
    if dtype == "bfloat16":  # values exact in bf16, so the reference sees the same inputs
        x = np.round(x * 8) / 8
    w = rng.random((T, K)).astype(np.float32)
    idx = _routing(rng, T, K, E)
    g = rng.standard_normal((T, H)).astype(np.float32)
    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    dev = _device(backend)
    with cs.Communicator(comm, backend=backend) as c:
        xt = torch.tensor(x, dtype=tdt, device=dev, requires_grad=True)
        wt = torch.tensor(w, device=dev, requires_grad=True)
        recv_x, recv_idx, recv_w, counts, handle = autograd.dispatch(c, xt, torch.tensor(idx, device=dev), wt, E)
        assert recv_idx.dtype == torch.int64 and recv_w.dtype == torch.float32 and recv_x.dtype == tdt
        scale = recv_w.sum(dim=1, keepdim=True) * float(rank + 1)
        z = (recv_x.float() * scale).to(tdt)
        y = autograd.combine(c, z, handle)
        loss = (y.float() * torch.tensor(g, device=dev)).sum()
        loss.backward()
        got_y = y.detach().float().cpu().numpy()
        got_gx = xt.grad.float().cpu().numpy()
        got_gw = wt.grad.cpu().numpy()
    owner = np.where(idx >= 0, idx // L, -1)
    ref_y = np.zeros((T, H), np.float64)
    ref_gx = np.zeros((T, H), np.float64)
    for r in range(W):
        wr = np.where(owner == r, w, 0).sum(axis=1)          # this token's weights held by rank r
        sent = (owner == r).any(axis=1)
        ref_y += np.where(sent[:, None], (r + 1) * x * wr[:, None], 0)
        ref_gx += np.where(sent[:, None], (r + 1) * g * wr[:, None], 0)
    ref_gw = np.where(owner >= 0, (owner + 1) * (x.astype(np.float64) * g).sum(axis=1)[:, None], 0)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(got_y, ref_y, rtol=tol, atol=tol * 4)
    np.testing.assert_allclose(got_gx, ref_gx, rtol=tol, atol=tol * 4)
    # grad_w goes through bf16 rounding of z and y in the bf16 case
    np.testing.assert_allclose(got_gw, ref_gw, rtol=tol, atol=tol * 8 * H)
    assert len(counts) == L


def test_wrong_device_and_unsupported_arguments(backend, comm):
    with cs.Communicator(comm, backend=backend) as c:
        x = torch.zeros((2, 4), device=_device(backend))
        idx = torch.zeros((2, 1), dtype=torch.int64, device=_device(backend))
        with pytest.raises(TypeError, match="argument 'x' must be a torch.Tensor"):
            autograd.dispatch(c, np.zeros((2, 4), np.float32), idx, None, comm.size)
        with pytest.raises(ValueError, match="'handle' is not supported"):
            autograd.dispatch(c, x, idx, None, comm.size, handle=object())
        if backend == "host" and torch.cuda.is_available():  # pragma: no cover (no GPU in CI)
            with pytest.raises(TypeError, match="takes cpu tensors"):
                autograd.dispatch(c, x.cuda(), idx, None, comm.size)
        if comm.size > 1 and backend == "host":  # rank 0 alone passes a bad x: it raises, the peers are told
            with pytest.raises((TypeError, ValueError)) as info:
                autograd.dispatch(c, np.zeros((2, 4), np.float32) if comm.rank == 0 else x, idx, None, comm.size)
            assert isinstance(info.value, TypeError) == (comm.rank == 0)
            if comm.rank != 0:
                assert isinstance(info.value, cs.SymBufferRejectedError)
        # the communicator is still usable
        y = c.alltoall(c.xp.arange(comm.size * 2, dtype=np.float32).reshape(comm.size, 2))
        assert y.shape == (comm.size, 2)
