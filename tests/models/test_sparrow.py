"""Sparrow's draft head (models.sparrow): one forward over a sequence equals the same sequence fed
row by row through its cache (positions, cache and mask agree); a prefix at negative positions is
seen; save and load keep every weight; a head for another target is refused clearly.

Tolerance: the incremental and the whole forward run the same operations on the same rows, but
the attention reduces over different key counts per call, so float32 sums may round differently
(~1e-6 relative on outputs of size ~1): ATOL 1e-5."""

from __future__ import annotations

import json

import pytest
import torch

from models.load import ModelError, load_model
from models.sparrow import CONFIG_FILE, HeadCache, SparrowConfig, SparrowHead

ATOL = 1e-5


@pytest.fixture(scope="module")
def target():
    return load_model("zoo/weights/qwen-target")


@pytest.fixture()
def head(target):
    torch.manual_seed(0)
    return SparrowHead(SparrowConfig.of_target(target)).eval()


@torch.no_grad()
def test_incremental_forward_equals_the_whole_sequence(head):
    z = torch.randn(7, head.config.hidden)
    whole = head(HeadCache.empty(head), z, torch.arange(7))
    cache, rows = HeadCache.empty(head), []
    for i in range(7):
        rows.append(head(cache, z[i:i + 1], torch.tensor([i]))[0])
    torch.testing.assert_close(torch.stack(rows), whole, atol=ATOL, rtol=0)
    assert cache.length == 7
    cache.crop(3)                   # rolled back, the next row sees only the first three
    again = head(cache, z[3:4], torch.tensor([3]))[0]
    torch.testing.assert_close(again, whole[3], atol=ATOL, rtol=0)


@torch.no_grad()
def test_a_mask_hides_what_it_should_and_a_prefix_is_seen(head):
    z = torch.randn(4, head.config.hidden)
    cache = HeadCache.empty(head)
    head(cache, z[:2], torch.arange(2))
    # two rows after the cache that do not see each other = each alone after the cache
    mask = torch.tensor([[True, True, True, False], [True, True, False, True]])
    both = head(cache, z[2:], torch.tensor([2, 2]), mask)
    for j in range(2):
        alone = HeadCache.empty(head)
        head(alone, z[:2], torch.arange(2))
        torch.testing.assert_close(head(alone, z[2 + j:3 + j], torch.tensor([2]))[0], both[j], atol=ATOL, rtol=0)
    plain = head(None, z[2:3], torch.tensor([0]))
    with_prefix = head(None, torch.cat([z[:2], z[2:3]]), torch.tensor([-2, -1, 0]))[-1:]
    assert not torch.allclose(plain, with_prefix)


def test_save_load_and_refusals(head, target, tmp_path):
    head.save(tmp_path / "h")
    loaded = SparrowHead.load(tmp_path / "h", target)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b.float(), atol=0, rtol=0, msg=name)
    with pytest.raises(ModelError, match="no sparrow.json"):
        SparrowHead.load(tmp_path / "nothing", target)
    config = json.loads((tmp_path / "h" / CONFIG_FILE).read_text())
    (tmp_path / "h" / CONFIG_FILE).write_text(json.dumps({**config, "hidden": 64}))
    with pytest.raises(ModelError, match="width 64"):
        SparrowHead.load(tmp_path / "h", target)


@pytest.mark.parametrize("pack", [True, "tiled"])
@torch.no_grad()
def test_a_head_loaded_beside_a_packed_target_is_packed_and_drafts_as_before(head, tmp_path, pack):
    """SparrowHead.load packs the head where its target is packed (models.packing), and tiles it,
    its FC too, where the target's are tiled: the same outputs (another kernel: ATOL), whole and
    over rows, and it saves the same weights."""
    head.save(tmp_path / "h")
    packed_target = load_model("zoo/weights/qwen-target", pack=pack, compile="default" if pack == "tiled" else "off")
    plain_target = load_model("zoo/weights/qwen-target", pack=False)
    packed, plain = SparrowHead.load(tmp_path / "h", packed_target), SparrowHead.load(tmp_path / "h", plain_target)
    assert packed.packed is not None and plain.packed is None
    assert (packed.fc_tiles is not None) == (pack == "tiled") and plain.fc_tiles is None
    z = torch.randn(5, head.config.hidden)
    torch.testing.assert_close(packed.fuse(z, z.flip(0)), plain.fuse(z, z.flip(0)), atol=ATOL, rtol=0)
    torch.testing.assert_close(packed(HeadCache.empty(packed), z, torch.arange(5)),
                               plain(HeadCache.empty(plain), z, torch.arange(5)), atol=ATOL, rtol=0)
    prefix_k, prefix_v = torch.randn(2, head.config.kv_heads, 6, head.config.head_dim)
    none_k = torch.zeros(head.config.kv_heads, 0, head.config.head_dim)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    for got, want in zip(packed.rows(z, torch.arange(6, 11), prefix_k, prefix_v, none_k, none_k, mask),
                         plain.rows(z, torch.arange(6, 11), prefix_k, prefix_v, none_k, none_k, mask)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    packed.save(tmp_path / "again")
    for (name, a), (_, b) in zip(SparrowHead.load(tmp_path / "again", plain_target).state_dict().items(),
                                 plain.state_dict().items()):
        assert torch.equal(a, b), name
