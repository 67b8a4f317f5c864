"""A conversation recognised from the prompt (`marsched.vllm.follow_ups`), on hashes chained as
vLLM chains them: a follow-up matches its own conversation, never another one, however much the
two share."""

from __future__ import annotations

import hashlib
import time

from marsched.vllm.follow_ups import FollowUps, PendingTurn, TurnKey, prompt_tail, still_cached, turn_keys

BLOCK = 4
SYSTEM = list(range(100, 112))  # three blocks of system prompt, the same in every conversation


def hashes(tokens: list[int]) -> list[bytes]:
    """One hash per full block, each over the one before it (vLLM's `hash_block_tokens`)."""
    out, parent = [], b""
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        parent = hashlib.sha256(parent + bytes(str(tokens[start:start + BLOCK]), "ascii")).digest()
        out.append(parent)
    return out


def finish(follow: FollowUps, conversation: str, prompt: list[int], reply: list[int], t: float = 0.0) -> None:
    blocks = len(hashes(prompt))
    follow.finished(conversation, len(prompt), blocks, hashes(prompt + reply), t,
                    prompt_tail(prompt, len(prompt), blocks, BLOCK))


def match(follow: FollowUps, tokens: list[int]) -> str | None:
    return follow.match(hashes(tokens), len(tokens), tokens)


def test_a_follow_up_matches_its_conversation_by_the_reply_or_the_prompt():
    follow = FollowUps()
    prompt, reply = SYSTEM + [1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]
    finish(follow, "a", prompt, reply)
    as_sent = prompt + reply + [50, 51, 52, 53, 54]  # the reply re-sent as written, then the tool's result
    assert match(follow, as_sent) == "a"
    rewritten = prompt + [9, 9, 9, 9, 9, 9, 9, 9]  # the template wrote the reply back otherwise
    assert match(follow, rewritten) == "a"
    assert follow.matched == 2


def test_conversations_with_the_same_system_prompt_never_match_each_other():
    """Built to tempt: many conversations share the system prompt and the reply; only the first user
    message differs, and it is short (one block)."""
    follow = FollowUps()
    reply = [6, 7, 8, 9, 10, 11, 12, 13]
    for user in range(50):
        finish(follow, f"c{user}", SYSTEM + [user, 0, 0, 0], reply)
    stranger = SYSTEM + [999, 0, 0, 0] + reply + [50, 51, 52, 53]
    assert match(follow, stranger) is None
    for user in range(50):
        mine = SYSTEM + [user, 0, 0, 0] + reply + [50, 51, 52, 53]
        assert match(follow, mine) == f"c{user}"
    assert follow.ambiguous == 0


def test_the_same_history_in_two_conversations_matches_neither():
    follow = FollowUps()
    prompt, reply = SYSTEM + [1, 2, 3, 4], [5, 6, 7, 8]
    finish(follow, "a", prompt, reply)
    finish(follow, "b", prompt, reply)
    tokens = prompt + reply + [9, 9, 9, 9]
    assert match(follow, tokens) is None
    assert follow.ambiguous == 1


def test_the_same_prompt_again_continues_nothing():
    """A retry, or another conversation replaying the same history, is not the turn's follow-up."""
    follow = FollowUps()
    prompt = SYSTEM + [1, 2, 3, 4, 5]
    finish(follow, "a", prompt, [6, 7, 8, 9, 10, 11])
    assert match(follow, prompt) is None
    shorter = SYSTEM
    assert match(follow, shorter) is None
    short_reply = SYSTEM + [7, 7, 7, 7]  # a reply that fills no block: its end is the prompt's last block
    finish(follow, "b", short_reply, [5, 6])
    assert match(follow, short_reply) is None
    assert match(follow, short_reply + [5, 6, 7]) == "b"


def test_a_later_turn_replaces_the_earlier_and_turns_expire():
    follow = FollowUps(window_s=10.0)
    first, reply = SYSTEM + [1, 1, 1, 1], [2, 2, 2, 2]
    finish(follow, "a", first, reply, t=0.0)
    second = first + reply + [3, 3, 3, 3]
    finish(follow, "a", second, [4, 4, 4, 4], t=5.0)
    assert match(follow, first + reply + [8, 8, 8, 8]) is None  # the old turn is gone
    assert len(follow) == 1 and not follow._owners.keys() - {k.hash for k in follow._turns["a"].keys}
    finish(follow, "b", SYSTEM + [7, 7, 7, 7], [2, 2, 2, 2], t=8.0)
    assert follow.expire(14.0) == []
    assert follow.expire(15.0) == ["a"]
    assert follow.expire(100.0) == ["b"] and not follow._owners


def test_the_least_recent_turns_go_first_past_the_limit():
    follow = FollowUps(limit=2)
    for name in "abc":
        finish(follow, name, SYSTEM + [ord(name)] * 4, [1, 1, 1, 1])
    assert list(follow._turns) == ["b", "c"]
    tokens = SYSTEM + [ord("a")] * 4 + [1, 1, 1, 1, 5, 5, 5, 5]
    assert match(follow, tokens) is None


def test_turn_keys():
    h = [b"a", b"b", b"c"]
    assert turn_keys(9, 2, h, [7]) == (TurnKey(b"c", 9), TurnKey(b"b", 9, [7]))  # the reply's end covers the prompt
    assert turn_keys(13, 3, h, [7]) == (TurnKey(b"c", 13, [7]),)  # the reply filled no block
    assert turn_keys(1, 0, []) == ()


def test_a_first_message_in_the_prompts_tail_is_checked_token_by_token():
    """The whole first user message (and the reply) fit in the prompt's last, partial block: the
    prompt's last full block is the shared system prompt's, which any conversation holds."""
    follow = FollowUps()
    finish(follow, "a", SYSTEM + [1, 2], [3])  # no block past the system prompt is full
    stranger = SYSTEM + [9, 9, 9, 9, 9, 9]  # longer, the same system prompt, another first message
    assert match(follow, stranger) is None
    assert follow.match(hashes(stranger), len(stranger)) is None  # no tokens to check: no match
    assert match(follow, SYSTEM + [1, 2, 3, 8, 8]) == "a"
    finish(follow, "b", SYSTEM + [5, 6, 7], [8, 8])  # the reply's end is full, the prompt's is not
    assert match(follow, SYSTEM + [5, 6, 7, 4, 4, 4, 4]) == "b"  # the reply rewritten: the prompt's end and tail
    assert match(follow, SYSTEM + [5, 6, 0, 4, 4, 4, 4]) is None


def test_a_pending_turn_is_taken_once_by_its_rid_and_dropped_by_its_follow_up():
    follow = FollowUps()
    turn = PendingTurn("a", "rid-1", "req-1", [1, 2], 2, [], [], time.monotonic())
    follow.wait_for_reply(turn)
    assert follow.replied("rid-2") is None
    assert follow.replied("rid-1") is turn and follow.replied("rid-1") is None
    follow.wait_for_reply(turn)
    follow.continued("a")  # the follow-up came first: the word on the reply is too late
    assert follow.replied("rid-1") is None and not follow.pending


def test_pending_turns_expire():
    follow = FollowUps()
    follow.wait_for_reply(PendingTurn("a", "rid-1", "req-1", [], 0, [], [], 0.0))
    follow.expire(30.0)
    assert follow.pending
    follow.expire(61.0)
    assert not follow.pending and follow.replied("rid-1") is None


class Block:
    def __init__(self, block_hash):
        self.block_hash = block_hash


def test_still_cached_stops_at_the_first_block_evicted_since():
    blocks = [Block(b"1"), Block(b"2"), Block(b"3")]
    assert still_cached(blocks, [b"1", b"2", b"3"]) == blocks
    blocks[1].block_hash = None  # evicted
    assert still_cached(blocks, [b"1", b"2", b"3"]) == blocks[:1]
    blocks[1].block_hash = b"x"  # reused for another prefix
    assert still_cached(blocks, [b"1", b"2", b"3"]) == blocks[:1]
