"""SGLang's cache-aware router worked by hand: the approximate radix tree (sgl-router/src/policies/
tree.rs at commit 4d40eec: `insert`, `prefix_match`, `get_smallest_tenant`, `evict_tenant_by_size`)
and the policy (sgl-router/src/policies/cache_aware.rs at commit 026f853: `select_worker`)."""

from kvsim.sim.cluster.radix_tree import ApproxRadixTree, shared_prefix
from kvsim.sim.cluster.routers import RouterView, make_router
from kvsim.sim.cluster.sglang import SglangCacheAware
from kvsim.sim.engine.config import SimConfig
from kvsim.workloads.request import make_request


def sizes(tree):
    """Characters per tenant recounted from the nodes (tree.rs `get_used_size_per_tenant`)."""
    out, stack = {}, [tree.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        for t in node.tenants:
            out[t] = out.get(t, 0) + len(node.text)
    return out


def test_shared_prefix():
    assert [shared_prefix(a, b) for a, b in (("apple", "apricot"), ("ab", "abc"), ("x", "y"), ("", "a"))] == [2, 2, 0, 0]


def test_insert_splits_nodes_and_counts_each_tenants_characters():
    # tree.rs test_tenant_char_count's first phase, counted by hand
    tree = ApproxRadixTree()
    tree.insert("apple", 1, 1)  # root -> "apple": 5
    tree.insert("apricot", 1, 2)  # split "ap" | "ple", new leaf "ricot": 5 + 5 = 10
    tree.insert("banana", 1, 3)  # 16
    tree.insert("amplify", 2, 4)  # split "a" | "p"; tenant 2 on "a" (1) and new leaf "mplify" (6): 7
    tree.insert("application", 2, 5)  # "a", then "p" (+1), split "pl" | "e" (+2), new leaf "ication" (+7): 17
    assert tree.char_count == {1: 16, 2: 17} == sizes(tree)
    a = tree.root.children["a"]
    assert (a.text, sorted(a.children)) == ("a", ["m", "p"])
    assert sorted(a.children["p"].children) == ["p", "r"]  # "p" -> "pl" (-> "e", "ication"), "ricot"
    assert a.children["p"].children["p"].text == "pl"
    assert a.children["p"].children["p"].tenants == {1: 1, 2: 5}  # the split kept 1's time (apple, 1); 2 touched it at 5


def test_prefix_match_stops_in_a_node_and_takes_its_lowest_tenant():
    tree = ApproxRadixTree()
    for stamp, (text, tenant) in enumerate([("apple", 1), ("apricot", 1), ("amplify", 2), ("application", 2)], 1):
        tree.insert(text, tenant, stamp)
    assert tree.prefix_match("apple", 10) == (5, 1)
    assert tree.prefix_match("applesauce", 11) == (5, 1)
    assert tree.prefix_match("apx", 12) == (2, 1)  # stops at "p", held by 1 and 2: the lowest
    assert tree.prefix_match("ampere", 13) == (3, 2)  # part-way into "mplify": its 2 characters count
    assert tree.prefix_match("zzz", 14) == (0, 1)  # the root, where both were stamped
    # a match stamps its tenant from the node up to the root
    amplify = tree.root.children["a"].children["m"]
    assert (amplify.tenants, tree.root.children["a"].tenants[2], tree.root.tenants) == ({2: 13}, 13, {1: 14, 2: 13})


def test_smallest_tenant_breaks_ties_low():
    tree = ApproxRadixTree()
    assert tree.smallest_tenant() is None
    tree.insert("ap", 1, 1)
    tree.insert("icot", 1, 2)
    tree.insert("cat", 2, 3)
    assert tree.smallest_tenant() == 2
    tree.insert("do", 4, 4)
    tree.insert("hi", 3, 5)
    assert tree.smallest_tenant() == 3  # 3 and 4 hold 2 characters each


def test_eviction_removes_least_recent_leaves_until_each_tenant_fits():
    tree = ApproxRadixTree()
    tree.insert("hello", 0, 1)
    tree.insert("help", 0, 2)  # "hel" | "lo", "p": tenant 0 holds 6
    tree.insert("world", 1, 3)  # 5
    tree.evict_by_size(4)
    # 0's leaves by time: "lo" (1) goes (6 -> 4), then "p" (2) is kept: 4 <= 4; 1's "world" goes (0)
    assert tree.char_count == {0: 4, 1: 0} == {**sizes(tree), 1: 0}
    hel = tree.root.children["h"]
    assert (list(tree.root.children), hel.text, list(hel.children)) == (["h"], "hel", ["p"])
    assert tree.prefix_match("hello", 4) == (3, 0)
    tree.evict_by_size(0)  # 0 loses "p" (2), then "hel" once it is 0's leaf; the root keeps both tenants
    assert (tree.char_count, tree.root.children, tree.root.tenants) == ({0: 0, 1: 0}, {}, {0: 4, 1: 3})


def text_request(name, tokens):
    return make_request(name, 0.0, tokens, 1)


def tokens(*first_bytes):
    """Tokens whose texts differ in their first character: chr(b) + three NULs each."""
    return [b << 24 for b in first_bytes]


def test_cold_start_spreads_by_tree_size_then_follows_matches():
    router = SglangCacheAware(3)
    view = RouterView(3)
    a, b, c = tokens(1, 2, 3, 4), tokens(5, 6), tokens(7, 8, 9)
    # every replica holds 0 characters: lowest first; then the one holding fewest
    assert router.pick(text_request("a", a), view) == 0  # 0 holds 16
    assert router.pick(text_request("b", b), view) == 1  # 1 holds 8
    assert router.pick(text_request("c", c), view) == 2  # 2 holds 12
    assert router.pick(text_request("d", tokens(10)), view) == 1  # 16, 8, 12: 1 (now 12)
    # 3 of 4 tokens match a's: rate 12/16 = 0.75 > 0.3
    assert router.pick(text_request("e", tokens(1, 2, 3, 11)), view) == 0
    assert router.tree.char_count == {0: 20, 1: 12, 2: 12}


def test_the_cache_threshold_is_strict():
    router = SglangCacheAware(2)
    view = RouterView(2)
    assert router.pick(text_request("a", tokens(*range(1, 11))), view) == 0  # 40 characters on 0
    # 3 of 10 tokens shared: 12/40 = 0.3, not above 0.3 (f32): the smaller tree, replica 1
    assert router.pick(text_request("b", tokens(1, 2, 3, *range(20, 27))), view) == 1
    # 4 shared: 16/40 = 0.4 > 0.3: replica 0 although it holds more (40 + 24 against 40)
    assert router.pick(text_request("c", tokens(1, 2, 3, 4, *range(30, 36))), view) == 0


def test_imbalance_falls_back_to_the_least_loaded_and_still_inserts():
    router = SglangCacheAware(3)
    view = RouterView(3)
    x = tokens(1, 2)
    router.tree.insert(router_text := "".join(chr(b) + "\0\0\0" for b in (1, 2)), 0, router._tick())
    view.dispatched = [70, 5, 6]  # 70 - 5 = 65 > 64 and 70 > 5 x 1.5: imbalanced
    assert router.imbalanced([70, 5, 6]) and router.pick(text_request("x", x), view) == 1
    assert router.tree.prefix_match(router_text, router._tick()) == (8, 0)  # 0 and 1 both hold it now
    view.dispatched = [69, 5, 6]  # 64 is not above 64: balanced, the match (replica 0) wins
    assert router.pick(text_request("x", x), view) == 0
    view.dispatched = [200, 130, 140]  # 70 > 64 and 200 > 195
    assert router.pick(text_request("y", tokens(9)), view) == 1
    view.dispatched, view.finished = [200, 135, 140], [0, 5, 0]  # outstanding 200, 130, 140 again
    assert router.pick(text_request("y", tokens(9)), view) == 1
    view.finished = [10, 0, 0]  # 190 is not above 130 x 1.5 = 195: balanced; y matches replica 1
    assert not router.imbalanced([190, 135, 140])
    assert router.pick(text_request("y", tokens(9)), view) == 1


def test_the_tree_is_evicted_at_each_interval_before_the_pick():
    router = SglangCacheAware(2, tree_size=8, eviction_interval=10.0)
    view = RouterView(2)
    x = tokens(1, 2, 3)
    assert router.pick(text_request("x", x), view) == 0  # 0 holds x's 12 characters
    router.tree.insert("\x09\0\0\0", 0, router._tick())  # and, touched later, 4 more: 16
    router._evict_if_due(9.9)  # the first eviction is due at 10
    assert router.tree.char_count == {0: 16, 1: 0}
    view.now = 25.0  # the evictions due at 10 and 20 run once, before the pick: x's leaf, the older, goes
    assert router.pick(text_request("x", x), view) == 1  # no match left: 1 holds fewer (0 against 4)
    assert router.tree.char_count == {0: 4, 1: 12}
    assert router.next_eviction == 30.0


def test_from_config_takes_the_options():
    cfg = SimConfig(replicas=2, router="sglang-cache-aware", router_cache_threshold=0.5, router_balance_abs=3,
                    router_balance_rel=2.0, router_tree_size=100, router_eviction_interval=5.0)
    router = make_router("sglang-cache-aware", 2, 0, cfg, num_blocks=77)
    assert (float(router.cache_threshold), router.balance_abs, float(router.balance_rel), router.tree_size,
            router.eviction_interval) == (0.5, 3, 2.0, 100, 5.0)
