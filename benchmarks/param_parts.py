"""Parts of parameters read per sample off one pass, against a pass per sample.

``python -m benchmarks.param_parts [--out DIR] [--repeats K]``: in one process at 1
thread, alone on the machine. A parameter the glue reads through a slice, a selection
or a split (OpenAI Whisper's text decoder adds ``positional_embedding[offset : offset +
T]`` to its tokens; a packed projection read as ``w.chunk(3)[k]``), or a table's rows
gathered by position ids in the glue (transformers' Whisper: ``weight[position_ids]``),
or a packed projection split by ``nn.MultiheadAttention`` for cross-attention
(``in_proj_weight.split([E, 2E])``), took one backward pass per sample through its
glue region. Now its products are read
off one pass and put at the part's elements (:class:`ggnchunk._graph.readers.Placed`;
the internal switch ``ggnchunk._graph.readers.READ_PARTS``). Each ``diag_ggn`` call runs
with and without, alternating (:func:`benchmarks.ab.alternate`): one untimed call
each, then the best of ``--repeats`` (default 1).

Writes ``param_parts.json``, ``param_parts.md`` and ``param_parts.png`` into ``--out``
(default ``benchmarks/results/param-parts``).
"""

from __future__ import annotations

from benchmarks import ab

NAMES = ("one pass per sample", "read per sample")  # the switch off, then on
VOCABULARY, TOKENS, WIDTH = 20, 8, 64


def _decoder(n: int, gathered: bool = False) -> tuple:
    """A Whisper-style text decoder: positions sliced (or gathered), 2 blocks, tied head.

    Token embedding, the positional table's rows for the tokens (OpenAI's
    ``positional_embedding[offset : offset + T]``, or with ``gathered``
    ``table[position_ids]`` as transformers writes it), two causal pre-norm
    ``nn.TransformerEncoderLayer`` blocks, a final norm and the logits as the product
    with the embedding table; per-token cross-entropy over 20 tokens.
    """
    import torch
    from torch import nn

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.token_embedding = nn.Embedding(VOCABULARY, WIDTH)
            self.positional_embedding = nn.Parameter(torch.randn(64, WIDTH) * 0.1)
            layer = nn.TransformerEncoderLayer(
                WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.ln = nn.LayerNorm(WIDTH)

        def forward(self, ids):
            t = ids.shape[1]
            if gathered:
                position_ids = torch.arange(t).expand(ids.shape[0], t)
                positions = self.positional_embedding[position_ids]
            else:
                positions = self.positional_embedding[2 : 2 + t]  # an offset
            x = self.token_embedding(ids) + positions
            mask = nn.Transformer.generate_square_subsequent_mask(t)
            x = self.ln(self.blocks(x, mask=mask, is_causal=True))
            return (x @ self.token_embedding.weight.T).transpose(1, 2)  # [N, V, T]

    ids = torch.randint(0, VOCABULARY, (n, TOKENS))
    return (
        Decoder().eval(),
        nn.CrossEntropyLoss(),
        ids,
        torch.randint(0, VOCABULARY, (n, TOKENS)),
    )


def _captioner(n: int) -> tuple:
    """``nn.TransformerDecoder`` attending to encoded features (cross-attention).

    torch's ``nn.MultiheadAttention`` reads its packed input projection in parts where
    the query is not the key (``in_proj_weight.split([E, 2E])``: the query's rows and
    the keys' and values'); 16 feature vectors projected by a ``nn.Linear``, 8 tokens,
    two pre-norm decoder layers, per-token cross-entropy over 20 tokens.
    """
    import torch
    from torch import nn

    class Captioner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCABULARY, WIDTH)
            self.memory = nn.Linear(32, WIDTH)
            layer = nn.TransformerDecoderLayer(
                WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
            )
            self.decoder = nn.TransformerDecoder(layer, 2)
            self.head = nn.Linear(WIDTH, VOCABULARY)

        def forward(self, ids, features):
            mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
            h = self.decoder(
                self.embed(ids), self.memory(features), tgt_mask=mask, tgt_is_causal=True
            )
            return self.head(h).transpose(1, 2)  # [N, V, T]

    inputs = (torch.randint(0, VOCABULARY, (n, TOKENS)), torch.randn(n, 16, 32))
    targets = torch.randint(0, VOCABULARY, (n, TOKENS))
    return Captioner().eval(), nn.CrossEntropyLoss(), inputs, targets


CASES = [
    # (name, title, builder, batch, chunking)
    ("sliced", "Whisper-style decoder, positions sliced", _decoder, 8, {"num_chunks": 4}),
    ("gathered", "Whisper-style decoder, positions gathered by id",
     lambda n: _decoder(n, gathered=True), 32, {"num_chunks": 4}),
    ("cross", "nn.TransformerDecoder, cross-attention", _captioner, 8, {"num_chunks": 4}),
    ("cross", "nn.TransformerDecoder, cross-attention", _captioner, 32, {"num_chunks": 4}),
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    ab.switch_main(
        argv,
        __doc__,
        "param_parts",
        1,
        module="ggnchunk._graph.readers",
        switch="READ_PARTS",
        names=NAMES,
        cases=CASES,
        title="Parts of parameters read per sample (issue 21)",
        ratio="per sample / read",
    )


if __name__ == "__main__":
    main()
