"""How far suffix decoding could go on recorded traffic: the requests a `specdec serve --learn DIR`
recorded (or `specdec bench --adapt` recorded into its out directory's traffic/), replayed in
their order through arctic-inference's suffix cache as drafters/suffix.py drives it, at several
settings, with no model.

    python benchmarks/bench_suffix_replay.py --from DIR [--settings 5:1:0.1,8:2:0.1,16:4:0.05]

A setting is k:max_spec_factor:min_token_prob (max_tree_depth 24, every request kept). Each round
drafts from the request's own tree and the shared one (the earlier requests' answers, and its own
so far), and accepts the deepest path of the draft tree that the recorded answer follows, then
one token more (the bonus): exactly what a greedy verify accepts when the traffic was greedy (for
sampled traffic, an upper estimate). Every round drafts: no goodput, so the numbers are what the
tree offers, not what a round can afford.

Printed per setting: tau (tokens a round), the draft nodes a round (the verify's width is one
more), and the share of rounds that accept nothing (the answers' own content, which no earlier
text holds). Then, at the widest setting, how often a drafted node is accepted by the probability
arctic-inference estimates for it, and the first node by the length of the match: whether the
estimates could choose a round's width.
"""

from __future__ import annotations

import argparse
import collections

from specdec.drafters.suffix import suffix_cache_class
from specdec.serve.recorder import read_requests

MAX_TREE_DEPTH = 24


def accepted_path(token_ids: list[int], parents: list[int], answer: list[int]) -> list[int]:
    """The draft nodes (indices) on the deepest path from the root that answer follows."""
    path, node = [], -1
    children = collections.defaultdict(dict)  # parent -> {token: node}
    for i, (token, parent) in enumerate(zip(token_ids, parents)):
        children[parent].setdefault(token, i)
    for token in answer:
        node = children[node].get(token, -2)
        if node == -2:
            break
        path.append(node)
    return path


def replay(requests: list[dict], k: int, factor: float, min_prob: float, observe=None) -> dict:
    """Every request drafted round by round; observe(draft, path) sees each round's draft."""
    cache = suffix_cache_class()(MAX_TREE_DEPTH, len(requests) + 1)
    rounds = tokens = nodes = empty_rounds = 0
    for key, request in enumerate(requests):
        prompt, answer = request["prompt"], request["output"]
        cache.start_request(key, prompt)
        emitted = 0
        while emitted < len(answer):
            context = (prompt + answer[:emitted])[-MAX_TREE_DEPTH:]
            draft = cache.speculate(
                key, context, max_spec_tokens=k, max_spec_factor=factor, min_token_prob=min_prob, use_tree_spec=True
            )
            path = accepted_path(list(draft.token_ids), list(draft.parents), answer[emitted:])
            if observe is not None:
                observe(draft, path)
            step = min(len(path) + 1, len(answer) - emitted)
            cache.add_active_response(key, answer[emitted : emitted + step])
            emitted += step
            rounds, tokens, nodes = rounds + 1, tokens + step, nodes + len(draft.token_ids)
            empty_rounds += not path
        cache.stop_request(key)
    return {"tau": tokens / rounds, "nodes": nodes / rounds, "nothing_accepted": empty_rounds / rounds}


def calibration(requests: list[dict], k: int, factor: float, min_prob: float) -> tuple[dict, dict]:
    """(by estimated probability decile: [nodes, accepted], by match length: [rounds, first node accepted])."""
    by_prob: dict = collections.defaultdict(lambda: [0, 0])
    by_match: dict = collections.defaultdict(lambda: [0, 0])

    def observe(draft, path):
        on_path = set(path)
        for i, prob in enumerate(draft.probs):
            counts = by_prob[min(int(prob * 10), 9)]
            counts[0], counts[1] = counts[0] + 1, counts[1] + (i in on_path)
        if draft.token_ids:
            counts = by_match[min(draft.match_len, 8)]
            counts[0], counts[1] = counts[0] + 1, counts[1] + bool(path)

    replay(requests, k, factor, min_prob, observe)
    return by_prob, by_match


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="directory", required=True, help="a --learn directory of recorded requests")
    parser.add_argument(
        "--settings",
        default="5:1:0.1,8:2:0.1,16:2:0.1,16:4:0.05,32:8:0",
        help="k:max_spec_factor:min_token_prob, comma-separated (the first: vLLM's defaults at k 5)",
    )
    args = parser.parse_args()
    requests = [r for r in read_requests(args.directory) if r["output"]]
    if not requests:
        raise SystemExit(f"{args.directory} holds no recorded request with an answer")
    settings = [(int(k), float(f), float(p)) for k, f, p in (s.split(":") for s in args.settings.split(","))]
    print(f"{len(requests)} recorded requests, {sum(len(r['output']) for r in requests)} answer tokens\n")
    print("| k | max_spec_factor | min_token_prob | tau | draft nodes a round | rounds accepting nothing |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k, factor, min_prob in settings:
        result = replay(requests, k, factor, min_prob)
        print(
            f"| {k} | {factor:g} | {min_prob:g} | {result['tau']:.2f} | {result['nodes']:.1f} | "
            f"{result['nothing_accepted']:.2f} |"
        )
    by_prob, by_match = calibration(requests, *settings[-1])
    print(f"\nAt k {settings[-1][0]}: a drafted node's estimated probability, and how often it was accepted\n")
    print("| estimate | nodes | accepted |\n|---|---:|---:|")
    for decile, (count, accepted) in sorted(by_prob.items()):
        print(f"| {decile / 10:.1f}-{(decile + 1) / 10:.1f} | {count} | {accepted / count:.2f} |")
    print("\n| match length | rounds | first node accepted |\n|---|---:|---:|")
    for length, (count, accepted) in sorted(by_match.items()):
        print(f"| {length}{'+' if length == 8 else ''} | {count} | {accepted / count:.2f} |")


if __name__ == "__main__":
    main()
