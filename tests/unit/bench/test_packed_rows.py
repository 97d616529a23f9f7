"""The benchmark's packed rows are the data loader's: documents of N tokens, positions restarting, first labels masked."""

import torch

from bench.common import packed_micro_batches
from mt_ray.models.context import document_spans


def test_rows_hold_whole_documents_then_padding():
    mbs = packed_micro_batches(vocab=96, batch=4, micro=2, seq=20, doc_tokens=6)
    assert len(mbs) == 2
    for mb in mbs:
        ids, labels, pos = mb["input_ids"], mb["labels"], mb["position_ids"]
        assert ids.shape == labels.shape == pos.shape == (2, 20)
        # three documents of 6 tokens, then 2 tokens of padding, in each row
        assert document_spans(pos) == [(0, 6), (6, 12), (12, 18), (18, 20), (20, 26), (26, 32), (32, 38), (38, 40)]
        docs = torch.arange(18)
        assert (labels[:, docs[docs % 6 == 0]] == -100).all()  # each document's first label
        inside = docs[docs % 6 != 0]
        assert torch.equal(labels[:, inside], ids[:, inside])
        assert (labels[:, 18:] == -100).all()  # padding carries no loss
    assert not torch.equal(mbs[0]["input_ids"], mbs[1]["input_ids"])


def test_pair_rows_hold_one_pair_with_one_masked_prompt():
    from bench.common import pair_micro_batches
    from mt_ray.data.schema import ROLE_CHOSEN, ROLE_REJECTED

    mbs = pair_micro_batches(vocab=96, batch=4, micro=2, seq=16)
    assert len(mbs) == 2
    for mb in mbs:
        assert mb["seq_role"][:, :2].tolist() == [[ROLE_CHOSEN, ROLE_REJECTED]] * 2
        assert document_spans(mb["position_ids"]) == [(0, 8), (8, 16), (16, 24), (24, 32)]
        ids, labels = mb["input_ids"], mb["labels"]
        assert torch.equal(ids[:, :4], ids[:, 8:12])  # chosen and rejected share the prompt
        assert (labels[:, :4] == -100).all() and (labels[:, 8:12] == -100).all()
        assert torch.equal(labels[:, 4:8], ids[:, 4:8]) and torch.equal(labels[:, 12:], ids[:, 12:])
