"""FactoredMatrix: a low-rank product A @ B kept as its two factors (TransformerLens's idea, kept small).

Used for the OV and QK circuits: [d_model, d_head] @ [d_head, d_model] per head, whose product is a
d_model x d_model matrix of rank d_head; the factors are what one should store and decompose.
"""

from __future__ import annotations

import warnings

import torch
from jaxtyping import Float


class FactoredMatrix:
    """A @ B with A [..., m, r] and B [..., r, n]; leading (batch) axes broadcast, e.g. [layer, head]."""

    def __init__(self, A: Float[torch.Tensor, "... m r"], B: Float[torch.Tensor, "... r n"]) -> None:
        if A.dim() < 2 or B.dim() < 2 or A.shape[-1] != B.shape[-2]:
            raise ValueError(
                f"FactoredMatrix needs A [..., m, r] and B [..., r, n], got {tuple(A.shape)} and {tuple(B.shape)}"
            )
        self.A, self.B = A, B

    @property
    def shape(self) -> torch.Size:
        lead = torch.broadcast_shapes(self.A.shape[:-2], self.B.shape[:-2])
        return torch.Size((*lead, self.A.shape[-2], self.B.shape[-1]))

    @property
    def AB(self) -> Float[torch.Tensor, "... m n"]:
        """The full product (m x n per leading index): large, built on demand."""
        return self.A @ self.B

    @property
    def BA(self) -> Float[torch.Tensor, "... r r"]:
        """B @ A (needs m == n): the small r x r matrix with the same non-zero eigenvalues as AB."""
        if self.A.shape[-2] != self.B.shape[-1]:
            raise ValueError(f"BA needs a square product, this one is {tuple(self.shape[-2:])}")
        return self.B @ self.A

    @property
    def T(self) -> FactoredMatrix:
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Thin SVD of AB without forming it, in TransformerLens's convention: (U [..., m, r'], S [..., r'],
        V [..., n, r']) with AB = U @ diag(S) @ V.transpose(-2, -1) (V, not torch.linalg.svd's Vh;
        r' = min(m, r, n)).

        Done in float32 at least: SVD of bfloat16 is not supported and loses the small singular values."""
        dtype = torch.promote_types(torch.promote_types(self.A.dtype, self.B.dtype), torch.float32)
        A, B = self.A.to(dtype), self.B.to(dtype)
        # AB = Ua Sa Vha B, and Sa Vha B is only r x n: decompose that small matrix instead.
        Ua, Sa, Vha = torch.linalg.svd(A, full_matrices=False)
        Um, S, Vh = torch.linalg.svd(Sa.unsqueeze(-1) * Vha @ B, full_matrices=False)
        return Ua @ Um, S, Vh.transpose(-2, -1)

    @property
    def U(self) -> torch.Tensor:
        """Left singular vectors [..., m, r']."""
        return self.svd()[0]

    @property
    def S(self) -> torch.Tensor:
        """Singular values [..., r'], largest first."""
        return self.svd()[1]

    @property
    def V(self) -> torch.Tensor:
        """Right singular vectors [..., n, r']: AB = U @ diag(S) @ V.transpose(-2, -1)."""
        return self.svd()[2]

    @property
    def Vh(self) -> torch.Tensor:
        """TransformerLens's (misnamed, deprecated) alias of V: returns V [..., n, r'], not its transpose."""
        warnings.warn(
            "FactoredMatrix.Vh returns V (right singular vectors, [..., n, r']), as in TransformerLens, not "
            "V.transpose(-2, -1); use .V",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.V

    def norm(self) -> torch.Tensor:
        """Frobenius norm of AB per leading index, from the singular values."""
        return self.S.pow(2).sum(-1).sqrt()

    @property
    def ldim(self) -> int:
        """m, the number of rows of AB (TransformerLens's name)."""
        return self.A.shape[-2]

    @property
    def rdim(self) -> int:
        """n, the number of columns of AB."""
        return self.B.shape[-1]

    @property
    def mdim(self) -> int:
        """r, the inner (hidden) size: AB's rank is at most r."""
        return self.A.shape[-1]

    def __getitem__(self, index) -> FactoredMatrix:
        """Index the leading axes (model.OV[layer, head]) and then, as TransformerLens, the rows (A's) and the
        columns (B's): OV[layer, head, :10, :10] keeps the product factored. An int on a leading axis drops it;
        on the row or column axis it keeps that axis with one entry (the product stays a matrix)."""
        index = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis or i is None for i in index):
            raise IndexError("FactoredMatrix indices are ints, slices or index lists per axis (no ... or None)")
        n_lead = len(self.shape) - 2
        if len(index) > n_lead + 2:
            raise IndexError(f"FactoredMatrix of shape {tuple(self.shape)}: too many indices ({len(index)})")
        lead = self.shape[:-2]
        A = self.A.expand(*lead, *self.A.shape[-2:])
        B = self.B.expand(*lead, *self.B.shape[-2:])
        A, B = A[index[:n_lead]], B[index[:n_lead]]
        rows, cols = (list(index[n_lead:]) + [slice(None), slice(None)])[:2]
        A = A[..., _keep_axis(rows, A.shape[-2]), :]
        B = B[..., _keep_axis(cols, B.shape[-1])]
        return FactoredMatrix(A, B)

    def __matmul__(self, other: torch.Tensor | FactoredMatrix) -> FactoredMatrix:
        if not isinstance(other, FactoredMatrix):
            return FactoredMatrix(self.A, self.B @ other)
        # (A B)(C D): keep the smaller of the two inner sizes as the new one
        if self.A.shape[-1] <= other.A.shape[-1]:
            return FactoredMatrix(self.A, self.B @ other.A @ other.B)
        return FactoredMatrix(self.A @ self.B @ other.A, other.B)

    def __rmatmul__(self, other: torch.Tensor) -> FactoredMatrix:
        """other @ (A B) = (other @ A) B: e.g. model.W_E @ model.OV, [..., d_vocab, d_model] kept factored."""
        return FactoredMatrix(other @ self.A, self.B)

    def __mul__(self, scalar: float | int | torch.Tensor) -> FactoredMatrix:
        """A scalar times AB (applied to A), as TransformerLens; a tensor must hold one number."""
        if isinstance(scalar, torch.Tensor) and scalar.numel() != 1:
            raise ValueError(f"FactoredMatrix * tensor needs one number, got a tensor of shape {tuple(scalar.shape)}")
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.A, self.B

    @property
    def eigenvalues(self) -> torch.Tensor:
        """The r eigenvalues of BA (complex): AB's non-zero eigenvalues, without forming AB (TransformerLens)."""
        return torch.linalg.eig(self.BA).eigenvalues

    def get_corner(self, k: int = 3) -> torch.Tensor:
        """AB's corner: its first k entries along every axis, leading ones included (TransformerLens's
        utils.get_corner of the product), computed from k rows of A and k columns of B only."""
        corner = self.A[..., :k, :] @ self.B[..., :, :k]
        return corner[tuple(slice(k) for _ in range(corner.dim()))]

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={tuple(self.shape)}, inner={self.A.shape[-1]})"


def _keep_axis(index, size: int):
    """An index of a matrix axis that keeps the axis: an int i becomes the one-element slice of i."""
    if isinstance(index, int) and not isinstance(index, bool):
        if not -size <= index < size:
            raise IndexError(f"index {index} out of range for a FactoredMatrix axis of size {size}")
        index %= size
        return slice(index, index + 1)
    return index
