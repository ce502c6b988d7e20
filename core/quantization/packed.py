"""AWQ, GPTQ and compressed-tensors checkpoints read as they are stored (``checkpoint.py``
says which).

``PackedReader.read`` stands between the checkpoint's tensors and the model's
``load_weights``: each quantized linear's parts (AWQ's and GPTQ's ``qweight``, ``qzeros``,
``scales`` and GPTQ's ``g_idx``; compressed-tensors' ``weight_packed``, ``weight_scale``,
``weight_shape`` and, where stored, ``weight_zero_point`` and ``weight_g_idx``) become a
``QuantizedWeight`` (``w = s * q + o``, ``o = -s * zero``) for the backend to run, and the
model is handed only the weight's shape: its fp32 ``weight``, ``scale * (q - zero)``, is
never written, so a model's linears never sit in memory in fp32 (``fill_unattached``
writes those that cannot run packed; a backend without the kernel writes the rest,
``weights.materialize``).

Both forms are exact: ``q - zero`` needs at most 9 bits and an fp16 or bf16 scale at most
11, so every product, and the sum ``s * q + o``, is an fp32 number with nothing rounded. The
outputs are those of the fp32 model whose weights are the checkpoint's dequantized values,
bit for bit; an fp16 dequantization (the GPU kernels') rounds some of them.

Act-order (GPTQ's ``desc_act``, compressed-tensors' ``actorder: group``) puts inputs of one
group anywhere in a row; the kernel wants groups of consecutive inputs, so such a linear
runs its exact fp32 weight instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from cadence.quantization.checkpoint import PackedSpec, method_label
from cadence.quantization.weights import QuantizedWeight

logger = logging.getLogger(__name__)

# AutoAWQ packs the 8 values of an int32 in this column order (slot i holds column
# AWQ_ORDER[i] of its 8): the reverse picks, for column j, the slot that holds it.
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
# Per method: (the parts every quantized linear stores, those it may store too).
_PARTS = {"awq": (("qweight", "qzeros", "scales"), ()),
          "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
          "compressed-tensors": (("weight_packed", "weight_scale", "weight_shape"),
                                 ("weight_zero_point", "weight_g_idx"))}


def _unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> the ``32 // bits`` values of each word, lowest bits first,
    [..., W, 32 // bits] int32 in 0..2^bits - 1."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


class PackedReader:
    """Turns a packed checkpoint's linears into fp32 weights as they stream past, keeping
    their ``QuantizedWeight`` under the weight's checkpoint name in ``blocks``."""

    def __init__(self, spec: PackedSpec, lean: bool = True) -> None:
        self.spec = spec
        #: Hand the model each packed weight's shape only (``load_weights``' ``shape_only``);
        #: off for a family whose ``convert_weight`` reorders or joins tensors, which then
        #: gets the dequantized weights, checked against the blocks like GGUF's.
        self.lean = lean
        self.blocks: dict[str, QuantizedWeight] = {}
        #: Linears whose groups are not consecutive inputs (act-order): fp32 only.
        self.dense: list[str] = []
        #: All-zero biases: AutoGPTQ saves one for every quantized linear, also in models
        #: whose linears have none; such a bias adds nothing, so a model without it skips it.
        self.zero_biases: set[str] = set()
        #: The weights ``read`` passed as their shape only (``blocks`` holds their values):
        #: the model never holds them in fp32 unless ``fill_unattached`` has to.
        self.shape_only: set[str] = set()

    def read(self, weights: Iterator[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
        required, optional = _PARTS[self.spec.method]
        # What completes a linear as it streams past; a part that may be missing (GPTQ's
        # g_idx) waits for the end of the checkpoint.
        complete = set(required) | {p for p in optional if self._expects(p)}
        # A linear's parts usually sit together, but a sharded checkpoint may split them.
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            prefix, _, part = name.rpartition(".")
            if part == "weight_zero_point" and self.spec.symmetric:
                # Some writers store a symmetric scheme's zero points anyway: all zero.
                if torch.count_nonzero(tensor - self._stored_zero(tensor)):
                    raise ValueError(f"compressed-tensors checkpoint: {name} holds zero points "
                                     "other than zero, but the scheme is symmetric")
                continue
            if part not in required and part not in optional:
                if part == "bias" and not torch.count_nonzero(tensor):
                    self.zero_biases.add(name)
                yield name, tensor
                continue
            parts = pending.setdefault(prefix, {})
            parts[part] = tensor
            if complete <= parts.keys():
                yield f"{prefix}.weight", self._linear(prefix, pending.pop(prefix))
        for prefix, parts in pending.items():
            yield f"{prefix}.weight", self._linear(prefix, parts)

    def _stored_zero(self, tensor: torch.Tensor) -> torch.Tensor | int:
        """What a zero point of zero looks like in ``tensor``: packed int32 words of
        2^(bits - 1) each, or 0 where it is stored unpacked (any other dtype)."""
        if tensor.dtype != torch.int32:
            return 0
        word = 0
        for i in range(32 // self.spec.bits):
            word |= (1 << (self.spec.bits - 1)) << (i * self.spec.bits)
        return torch.tensor(word, dtype=torch.int64).to(torch.int32)

    def _expects(self, part: str) -> bool:
        if part == "g_idx":
            return True  # AutoGPTQ stores it; a checkpoint without it ends at the end
        if part == "weight_zero_point":
            return not self.spec.symmetric
        return self.spec.desc_act  # weight_g_idx

    def _linear(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        required, _ = _PARTS[self.spec.method]
        missing = [p for p in required if p not in parts]
        if not self.spec.symmetric and "weight_zero_point" not in parts:
            missing.append("weight_zero_point")
        if missing:
            raise ValueError(f"{self.spec.method} checkpoint: {prefix} has "
                             f"{', '.join(sorted(parts))} but no {', '.join(missing)}")
        q, zeros, scales = self._unpack(prefix, parts)
        k = q.shape[1]
        groups = scales.shape[1]
        size = self.spec.group_size
        if k % groups or (size > 0 and groups > 1 and k // groups != size):
            raise ValueError(f"{self.spec.method} checkpoint: {prefix} has {k} inputs and "
                             f"{groups} groups of scales, which are not whole groups of "
                             f"group_size {size}; a last group shorter than the others is "
                             "not read")
        g_idx = parts.get("g_idx", parts.get("weight_g_idx"))
        consecutive = torch.arange(k, dtype=torch.int64) // (k // groups)
        if g_idx is not None and g_idx.shape != (k,):
            raise ValueError(f"{self.spec.method} checkpoint: {prefix} has a g_idx of shape "
                             f"{tuple(g_idx.shape)}, expected ({k},)")
        if g_idx is None or torch.equal(g_idx.long(), consecutive):
            weight = self._blocks(q, zeros, scales)
            self.blocks[f"{prefix}.weight"] = weight
            if not self.lean:
                return weight.dequantize()
            self.shape_only.add(f"{prefix}.weight")
            # Its shape only, in no memory (a stride-0 view): the values stay packed.
            return torch.zeros((), dtype=torch.float32).expand(weight.shape)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{self.spec.method} checkpoint: {prefix}'s g_idx names groups "
                             f"outside 0..{groups - 1}")
        self.dense.append(prefix)
        g = g_idx.long()
        codes = q if zeros is None else q - zeros[:, g]
        return scales[:, g] * codes.float()

    def _unpack(self, prefix: str, parts: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(q [N, K] int32, zero points [N, G] int32 or None, scales [N, G] fp32)."""
        bits, spec = self.spec.bits, self.spec
        words = [n for n in ("qweight", "qzeros", "weight_packed", "weight_zero_point")
                 if n in parts]
        wrong = [n for n in words if parts[n].dtype != torch.int32]
        if wrong:
            raise ValueError(f"{spec.method} checkpoint: {prefix}.{wrong[0]} must be int32, "
                             f"got {parts[wrong[0]].dtype}")
        if spec.method == "compressed-tensors":
            return self._unpack_compressed(prefix, parts)
        qweight, qzeros = parts["qweight"], parts["qzeros"]
        scales = parts["scales"].float()
        if spec.method == "awq":
            # [K, N / 8] and [G, N / 8]: packed along the outputs, in AWQ's order.
            q = _unpack_words(qweight, bits)[..., AWQ_REVERSE_ORDER].flatten(1).t()
            zeros = _unpack_words(qzeros, bits)[..., AWQ_REVERSE_ORDER].flatten(1).t()
        else:
            # [K * bits / 32, N] packed along the inputs; zeros [G, N * bits / 32] along
            # the outputs, both in order.
            q = _unpack_words(qweight.t(), bits).flatten(1)
            zeros = _unpack_words(qzeros, bits).flatten(1).t() + spec.zero_offset
        scales = scales.t()
        if zeros.shape != scales.shape or q.shape[0] != scales.shape[0]:
            raise ValueError(f"{spec.method} checkpoint: {prefix} has qweight "
                             f"{tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                             f"scales {tuple(parts['scales'].shape)}, which do not fit "
                             f"{bits}-bit packing")
        return q.contiguous(), zeros.contiguous(), scales.contiguous()

    def _unpack_compressed(self, prefix: str, parts: dict[str, torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        # weight_packed [N, ceil(K * bits / 32)] along the inputs, in order, each value
        # stored plus 2^(bits - 1); weight_zero_point [ceil(N * bits / 32), G] the same
        # along the outputs; weight_scale [N, G]; weight_shape the unpadded [N, K].
        bits, half = self.spec.bits, 1 << (self.spec.bits - 1)
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        scales = parts["weight_scale"].float().reshape(n, -1)
        q = _unpack_words(parts["weight_packed"], bits).flatten(1)
        if q.shape[0] != n or q.shape[1] < k:
            raise ValueError(f"compressed-tensors checkpoint: {prefix}.weight_packed has shape "
                             f"{tuple(parts['weight_packed'].shape)}, which does not hold "
                             f"weight_shape [{n}, {k}] at {bits} bits")
        q = q[:, :k] - half
        zeros = None
        if "weight_zero_point" in parts:
            zeros = _unpack_words(parts["weight_zero_point"].t(), bits).flatten(1)[:, :n].t()
            zeros = zeros - half
            if zeros.shape != scales.shape:
                raise ValueError(f"compressed-tensors checkpoint: {prefix}.weight_zero_point "
                                 f"gives {tuple(zeros.shape)} zero points for "
                                 f"{tuple(scales.shape)} scales")
        return q.contiguous(), None if zeros is None else zeros.contiguous(), \
            scales.contiguous()

    def _blocks(self, q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor
                ) -> QuantizedWeight:
        # int8 holds 4-bit values and signed 8-bit ones as they are; unsigned 8-bit ones
        # shifted by 128, the shift folded into the offset (exact, like the rest).
        shift = 128 if int(q.max()) > 127 else 0
        if zeros is None and not shift:
            return QuantizedWeight(q.to(torch.int8), scales, None)
        base = zeros if zeros is not None else torch.zeros_like(scales, dtype=torch.int32)
        offset = scales * (shift - base).float()
        return QuantizedWeight((q - shift).to(torch.int8), scales, offset)

    def fill_unattached(self, model: torch.nn.Module, attached: set[str]) -> None:
        """Write the fp32 weights of the linears read as their shape only that did not get
        their packed values attached (a fused projection one of whose parts is act-order, a
        tensor-parallel share that would split a group, a name the model converts): they
        run their exact fp32 weights."""
        from cadence.quantization.weights import write_unattached

        left = self.shape_only - attached
        write_unattached(model, left, ((n, self.blocks[n].dequantize()) for n in sorted(left)),
                         method_label(self.spec.method))

    def report(self) -> None:
        if self.dense:
            logger.warning("%d %s linear(s) use act-order groups (desc_act), which are not "
                           "runs of consecutive inputs; they run their exact fp32 weights, "
                           "not the packed ones: %s", len(self.dense),
                           method_label(self.spec.method), ", ".join(self.dense[:3]) +
                           (", ..." if len(self.dense) > 3 else ""))
