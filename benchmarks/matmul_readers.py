"""Weights of the glue's matrix products read per sample, against a pass per sample.

``python -m benchmarks.matmul_readers [--out DIR] [--repeats K]``: in one process at 1
thread, alone on the machine. A parameter that the glue multiplies with ``@``,
``matmul``, ``bmm`` or ``baddbmm`` (a tied vocabulary head ``x @ embedding.weight.T`` as
Whisper and GPT-2 write it, CLIP's ``x[eot] @ text_projection``, per-head weights
``[N, H, T, D] @ [H, D, E]``, a value head ``h @ v``) is folded over the columns by the
glue's kernels; its products were then taken with one backward pass per sample through
its glue region. Now they are read off one pass
(:class:`ggnchunk._graph.readers.Product` on the folded node, each output row with the
weight it uses; the internal switch
``ggnchunk._graph.readers.READ_FOLDED_PRODUCTS``). Each ``diag_ggn`` call runs with and
without, alternating (:func:`benchmarks.ab.alternate`): one untimed call each, then the
best of ``--repeats`` (default 1).

Writes ``matmul_readers.json``, ``matmul_readers.md`` and ``matmul_readers.png`` into
``--out`` (default ``benchmarks/results/matmul-readers``).
"""

from __future__ import annotations

from benchmarks import ab
from benchmarks.param_parts import _decoder

NAMES = ("one pass per sample", "read per sample")  # the switch off, then on
VOCABULARY, TOKENS, WIDTH = 20, 8, 64


def _clip_text(n: int) -> tuple:
    """A CLIP-style text tower: the end token's features times ``text_projection``.

    Token and position embeddings, two causal pre-norm ``nn.TransformerEncoderLayer``
    blocks, a final norm; the features at each sequence's end token projected as
    OpenAI's CLIP does (``x[arange(N), eot] @ text_projection``, 64 → 32), then scored
    against 10 fixed class embeddings; cross-entropy over the classes.
    """
    import torch
    from torch import nn

    class Text(nn.Module):
        def __init__(self):
            super().__init__()
            self.token_embedding = nn.Embedding(VOCABULARY, WIDTH)
            self.positional_embedding = nn.Parameter(torch.randn(TOKENS, WIDTH) * 0.1)
            layer = nn.TransformerEncoderLayer(
                WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.ln_final = nn.LayerNorm(WIDTH)
            self.text_projection = nn.Parameter(torch.randn(WIDTH, 32) * WIDTH**-0.5)
            self.register_buffer("classes", torch.randn(10, 32))

        def forward(self, ids):
            t = ids.shape[1]
            x = self.token_embedding(ids) + self.positional_embedding
            mask = nn.Transformer.generate_square_subsequent_mask(t)
            x = self.ln_final(self.blocks(x, mask=mask, is_causal=True))
            features = x[torch.arange(x.shape[0]), ids.argmax(-1)] @ self.text_projection
            return features @ self.classes.T

    ids = torch.randint(0, VOCABULARY, (n, TOKENS))
    return Text().eval(), nn.CrossEntropyLoss(), ids, torch.randint(0, 10, (n,))


def _heads(n: int) -> tuple:
    """A token mixer with a weight per head, written ``[N, H, T, D] @ [H, D, E]``.

    Tokens ``[N, 16, 64]`` projected by a ``nn.Linear``, split into 4 heads of 16, each
    head's tokens times its own ``[16, 64]`` weight and back (``[4, 64, 16]``), a
    residual, a norm and a 10-class head on the mean token.
    """
    import torch
    from torch import nn

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(WIDTH, WIDTH)
            self.up = nn.Parameter(torch.randn(4, 16, WIDTH) * 0.25)
            self.down = nn.Parameter(torch.randn(4, WIDTH, 16) * 0.125)
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, 10)

        def forward(self, x):
            n, t, _ = x.shape
            h = torch.tanh(self.inp(x)).view(n, t, 4, 16).transpose(1, 2)
            h = torch.relu(h @ self.up) @ self.down  # [N, 4, T, 16]
            x = self.norm(x + h.transpose(1, 2).reshape(n, t, WIDTH))
            return self.head(x.mean(1))

    return (
        Heads().eval(),
        nn.CrossEntropyLoss(),
        torch.randn(n, 16, WIDTH),
        (torch.randint(0, 10, (n,))),
    )


def _value_head(n: int) -> tuple:
    """Per-token values ``h @ v`` with a vector ``v`` (a value head, an attention pool).

    Tokens ``[N, 16, 64]`` through a ``nn.Linear`` and ``tanh``, then each token's
    score ``h @ v`` (``v`` of 64), regressed to a target per token (MSE).
    """
    import torch
    from torch import nn

    class Values(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(WIDTH, WIDTH)
            self.v = nn.Parameter(torch.randn(WIDTH) * WIDTH**-0.5)

        def forward(self, x):
            return torch.tanh(self.inp(x)) @ self.v  # [N, 16]

    return Values().eval(), nn.MSELoss(), torch.randn(n, 16, WIDTH), torch.randn(n, 16)


CASES = [
    # (name, title, builder, batch, chunking)
    ("tied", "Whisper-style decoder, tied head x @ E.T", _decoder, 8, {"num_chunks": 4}),
    ("tied", "Whisper-style decoder, tied head x @ E.T", _decoder, 32, {"num_chunks": 4}),
    ("clip", "CLIP-style text tower, x[eot] @ text_projection", _clip_text, 32, {}),
    ("heads", "per-head weights, [N, H, T, D] @ [H, D, E]", _heads, 32, {}),
    ("vector", "value head, h @ v", _value_head, 32, {}),
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    ab.switch_main(
        argv,
        __doc__,
        "matmul_readers",
        1,
        module="ggnchunk._graph.readers",
        switch="READ_FOLDED_PRODUCTS",
        names=NAMES,
        cases=CASES,
        title="Weights of the glue's matrix products read per sample (issue 21)",
        ratio="per sample / read",
    )


if __name__ == "__main__":
    main()
