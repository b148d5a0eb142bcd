"""`rollout.placement.mode: separate`, the parts that need no engine: which rank does what, how a
step's prompts are split across the engines and put back, the sync's checksums, the config's
refusals, and the link's messages between two real gloo processes. The runs themselves:
tests/test_separate_e2e.py."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from megarl.config import load_config
from megarl.distributed.link import Inbox, Outbox, broadcast, recv_object
from megarl.distributed.placement import Job, JobPlacement, PlacementError, init_job
from megarl.rollout.metrics import staleness_metrics
from megarl.rollout.placement.separate import Request, merge_samples, split_shares, syncs_to_verify
from megarl.rollout.samples import Samples, Versions, token_versions
from megarl.rollout.sync.buckets import (
    IN_FLIGHT,
    bucket_items,
    bucket_layout,
    receive_buckets,
    send_buckets,
    timed_broadcasts,
)
from megarl.rollout.sync.checksum import FamilySums, family, merged, mismatched, tensor_sums
from megarl.rollout.sync.receiver import Receiver
from megarl.rollout.sync.separate import BUCKET_BYTES, WeightsCheck


# ----------------------------------------------------------------------------- placement
def test_split_gives_the_last_ranks_to_the_engines():
    roles = [JobPlacement.split(r, 5, "separate", 2) for r in range(5)]
    assert [(p.role, p.rank, p.world) for p in roles] == [
        ("train", 0, 3),
        ("train", 1, 3),
        ("train", 2, 3),
        ("rollout", 0, 2),
        ("rollout", 1, 2),
    ]
    # the link: trainer rank 0 is member 0, engine i is member 1 + i; other trainers are not in it
    assert [p.link_rank for p in roles] == [0, None, None, 1, 2]


def test_colocated_is_the_whole_job_training():
    p = JobPlacement.split(3, 4, "colocated", 2)  # rollout.placement.ranks is not read
    assert (p.role, p.rank, p.world, p.separate, p.link_rank) == ("train", 3, 4, False, None)


@pytest.mark.parametrize("world,engines", [(2, 2), (1, 1), (3, 0)])
def test_split_refuses_a_job_without_trainers_or_engines(world, engines):
    with pytest.raises(PlacementError, match=f"ranks={engines} of a {world}-rank job"):
        JobPlacement.split(0, world, "separate", engines)


def test_split_refuses_an_unknown_placement():
    with pytest.raises(PlacementError, match="accepted: \\('colocated', 'separate'\\)"):
        JobPlacement.split(0, 2, "remote", 1)


# ----------------------------------------------------------------------------- dispatch
def _rollout(prompts: list[list[int]], n: int, tag: int) -> Samples:
    """n samples per prompt; each sample's response names its engine, prompt and sample."""
    ro = Samples.empty()
    for i, p in enumerate(prompts):
        for k in range(n):
            ro.prompt_index.append(i)
            ro.prompt_ids.append(p)
            ro.response_ids.append([tag, p[0], k])
            ro.response_logprobs.append([-0.5, -0.25, -0.125])
            ro.finish_reason.append("stop")
    return ro


@pytest.mark.parametrize("engines", [1, 2, 3])
def test_each_prompt_is_generated_once_and_returned_to_its_dp_ranks(engines):
    # 4 trainer ranks: DP=2 x TP=2 (ranks 0, 1 hold DP rank 0; ranks 2, 3 DP rank 1)
    dp0 = ([[10], [11], [12]], [0, 1, 2])
    dp1 = ([[20], [21], [22]], [3, 4, 5])
    shares = [(0, *dp0), (0, *dp0), (1, *dp1), (1, *dp1)]
    chunks, requests = split_shares(shares, engines)
    sent = [p for prompts, _ in requests for p in prompts]
    assert sorted(sent) == [[10], [11], [12], [20], [21], [22]]  # once each
    assert [pos for _, positions in requests for pos in positions] == [0, 1, 2, 3, 4, 5]
    outs = [_rollout(prompts, 2, tag=e) for e, (prompts, _) in enumerate(requests)]
    per_rank = merge_samples(shares, chunks, outs)
    for rank, (_, prompts, _) in enumerate(shares):
        ro = per_rank[rank]
        assert ro.prompt_index == [0, 0, 1, 1, 2, 2]
        assert [r[1:] for r in ro.response_ids] == [[p[0], k] for p in prompts for k in (0, 1)]
        assert ro.prompt_ids == [p for p in prompts for _ in (0, 1)]


def test_a_dp_rank_without_prompts_gets_an_empty_rollout():
    shares = [(0, [[1], [2]], [0, 1]), (1, [], [])]
    chunks, requests = split_shares(shares, 2)
    outs = [_rollout(prompts, 1, tag=e) for e, (prompts, _) in enumerate(requests)]
    first, second = merge_samples(shares, chunks, outs)
    assert first.prompt_index == [0, 1] and len(second) == 0


# ----------------------------------------------------------------------------- checksums
def test_families_replace_the_layer_index():
    assert family("model.layers.11.mlp.down_proj.weight") == "model.layers.N.mlp.down_proj.weight"
    assert family("model.embed_tokens.weight") == "model.embed_tokens.weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_changed_bit_a_swap_or_a_missing_tensor_changes_the_checksums(dtype):
    torch.manual_seed(0)
    t = torch.randn(64, 33).to(dtype)
    base = tensor_sums(t)
    assert tensor_sums(t.clone()) == base  # equal bytes, equal sums
    flipped = t.clone()
    flipped.view(torch.int16 if t.element_size() == 2 else torch.int32).view(-1)[100] ^= 1
    assert tensor_sums(flipped) != base
    swapped = t.clone().view(-1)
    a, b = 4, 4 + 8 // t.element_size()  # the first values of two 8-byte words
    swapped[[a, b]] = swapped[[b, a]]
    assert tensor_sums(swapped)[0] == base[0] and tensor_sums(swapped) != base  # order counts
    within = t.clone().view(-1)
    within[[a, a + 1]] = within[[a + 1, a]]  # two values of one word
    assert tensor_sums(within) != base
    assert tensor_sums(t.view(-1)[1:]) == tensor_sums(t.view(-1)[1:].clone())  # off 8-byte
    sent, got = FamilySums(), FamilySums()
    for i in range(3):
        sent.add(f"model.layers.{i}.mlp.down_proj.weight", t)
        sent.add(f"model.layers.{i}.input_layernorm.weight", t[0])
        if i != 1:  # one layer's down_proj never arrived
            got.add(f"model.layers.{i}.mlp.down_proj.weight", t)
        got.add(f"model.layers.{i}.input_layernorm.weight", t[0])
    assert mismatched(sent.state(), got.state()) == ["model.layers.N.mlp.down_proj.weight"]


def test_checksums_do_not_depend_on_the_threads_that_add_them():
    t = torch.randn(3000, 1500)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tensor_sums(t)
        torch.set_num_threads(max(threads, 2))
        assert tensor_sums(t) == one
    finally:
        torch.set_num_threads(threads)


def test_a_value_moved_to_another_row_or_column_changes_the_weighted_sum():
    t = torch.zeros(4096, dtype=torch.int32)  # rows of 512 8-byte words: 1024 int32 values
    t[5] = 7
    moved = [torch.zeros_like(t) for _ in range(3)]
    moved[0][1024 + 5] = 7  # next row, same column
    moved[1][7] = 7  # same row, next column (the same half of the next word)
    moved[2][4095] = 7  # elsewhere
    sums = {tensor_sums(x) for x in (t, *moved)}
    assert len(sums) == 4 and len({s[0] for s in sums}) == 1


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.engine.tensor_parallel=2"], "tensor_parallel=2: each engine rank runs one"),
        (["rollout.engine.routing_replay=true"], "routing replay is captured in the trainer's"),
        (["rollout.engine.sleep_between_steps=true"], "an engine rank owns its GPU and never"),
        (["algorithm.name=sft"], "algorithm.name=sft builds no rollout"),
    ],
)
def test_config_refuses_what_separate_does_not_do(overrides, message):
    with pytest.raises(Exception, match=message):
        load_config(None, ["rollout.placement.mode=separate", *overrides])


@pytest.mark.parametrize(
    "mode, utilization, sleeps", [("colocated", 0.5, True), ("separate", 0.9, False)]
)
def test_each_placement_sizes_and_sleeps_its_engines_unless_told(mode, utilization, sleeps):
    """A colocated engine shares its GPU with the trainer and sleeps while it trains; an engine
    rank owns its GPU and never sleeps. Stated values are kept."""
    engine = load_config(None, [f"rollout.placement.mode={mode}"]).rollout.engine
    assert (engine.gpu_memory_utilization, engine.sleep_between_steps) == (utilization, sleeps)
    stated = [
        "rollout.engine.gpu_memory_utilization=0.7",
        "rollout.engine.sleep_between_steps=false",
    ]
    engine = load_config(None, [f"rollout.placement.mode={mode}", *stated]).rollout.engine
    assert (engine.gpu_memory_utilization, engine.sleep_between_steps) == (0.7, False)


def test_config_refuses_an_unknown_placement():
    with pytest.raises(Exception, match="placement.mode='remote'; accepted: colocated or sep"):
        load_config(None, ["rollout.placement.mode=remote"])


# ----------------------------------------------------------------------------- the link
def _gloo_pair(member: int, port: int):
    """Member `member` of a two-member gloo group on this machine (the link's kind)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=member == 0)
    return dist.ProcessGroupGloo(dist.PrefixStore("link", store), member, 2, timedelta(seconds=60))


def _link_peer(member: int, port: int, errors) -> None:
    try:
        pg = _gloo_pair(member, port)
        if member == 0:
            # both members send before they receive: gloo completes a send at its receive, so
            # waiting for the send here would wait for ever
            out = Outbox(pg)
            out.send({"op": "generate", "prompts": [[1, 2, 3]], "big": "x" * 100_000}, 1)
            out.send({"op": "more"}, 1)
            assert recv_object(pg, 1) == {"early": True}
            reply = recv_object(pg, 1)
            assert reply == {"echo": [[1, 2, 3]], "size": 100_000}, reply
            out.flush()
            broadcast(pg, torch.arange(10, dtype=torch.bfloat16))
        else:
            out = Outbox(pg)
            out.send({"early": True}, 0)
            msg = recv_object(pg, 0)
            assert recv_object(pg, 0) == {"op": "more"}
            out.send({"echo": msg["prompts"], "size": len(msg["big"])}, 0)
            t = torch.zeros(10, dtype=torch.bfloat16)
            broadcast(pg, t)
            assert torch.equal(t, torch.arange(10, dtype=torch.bfloat16)), t
            out.flush()
    except BaseException as e:  # reported to the test, which fails with it
        errors.put(f"member {member}: {type(e).__name__}: {e}")


def _bucket_tensors() -> list:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (300,), (1000,), (5,), (64, 2), (1,)]  # 1000 x 2 bytes: over the limit
    return [
        (f"model.layers.{i % 2}.t{i}.weight", torch.randn(s, generator=g).bfloat16())
        for i, s in enumerate(shapes)
    ]


def _bucket_peer(member: int, port: int, errors, report) -> None:
    """The bucket round trip, then the stream of `_bounded_send` (one launch for both tests)."""
    try:
        pg = _gloo_pair(member, port)
        tensors = _bucket_tensors()
        buckets = bucket_layout(tensors, 1024)
        sums = FamilySums()
        if member == 0:
            send_buckets(pg, tensors, buckets, torch.bfloat16, sums)
            out = Outbox(pg)
            out.send(sums.state(), 1)
            out.flush()  # taken before this process ends
            report.put(_bounded_send(pg))
            return
        flats = receive_buckets([(0, pg, buckets)], torch.bfloat16)
        got = list(bucket_items(buckets, flats))
        assert [n for n, _ in got] == [n for n, _ in tensors]
        for (name, t), (_, want) in zip(got, tensors, strict=True):
            assert torch.equal(t, want), name
            sums.add(name, t)
        assert mismatched(recv_object(pg, 0), sums.state()) == []
        stream = _stream_buckets()  # every tensor of the stream arrives, bit for bit
        flats = receive_buckets([(0, pg, stream)], torch.float32)
        for i, (name, t) in enumerate(bucket_items(stream, flats)):
            assert torch.equal(t, torch.full((16, 16), float(i))), name
    except BaseException as e:  # reported to the test, which fails with it
        errors.put(f"member {member}: {type(e).__name__}: {e}")


# 24 tensors of 1 KiB in fp32, cut into 2 KiB buckets: 12 buckets, three times IN_FLIGHT
_STREAM = [(f"model.layers.{i}.mlp.down_proj.weight", (16, 16)) for i in range(24)]


def _stream_buckets() -> list:
    return bucket_layout([(n, torch.empty(s, device="meta")) for n, s in _STREAM], 2048)


def _bounded_send(pg) -> dict:
    """Member 0: send `_STREAM` through `send_buckets`, its tensors made one at a time as it
    asks for them; returns the most buckets and tensors the sender held at once."""
    import sys
    import weakref

    from megarl.distributed import link
    from megarl.rollout.sync import buckets as module

    seen = {"held": 0, "buckets": 0, "tensors": 0}
    made: list = []  # weakrefs to the tensors the stream made

    def stream():
        for i, (name, shape) in enumerate(_STREAM):
            t = torch.full(shape, float(i))
            made.append(weakref.ref(t))
            seen["tensors"] = max(seen["tensors"], sum(r() is not None for r in made))
            yield name, t
            del t

    # a bucket is held from its allocation in `send_buckets` until `Broadcasts.wait` lets its
    # broadcast go (what the sender's code keeps, whatever gloo's threads still hold)
    empty, wait = torch.empty, link.Broadcasts.wait

    def counted_empty(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == module.__name__:
            seen["held"] += 1
            seen["buckets"] = max(seen["buckets"], seen["held"])
        return empty(*args, **kwargs)

    def counted_wait(self, keep: int = 0):
        before = len(self.works)
        try:
            return wait(self, keep)
        finally:
            seen["held"] -= before - len(self.works)

    buckets = _stream_buckets()
    torch.empty, link.Broadcasts.wait = counted_empty, counted_wait
    try:
        send_buckets(pg, stream(), buckets, torch.float32, FamilySums())
    finally:
        torch.empty, link.Broadcasts.wait = empty, wait
    return {"buckets": seen["buckets"], "tensors": seen["tensors"], "of": len(buckets)}


@pytest.fixture(scope="module")
def bucket_pair() -> dict:
    """One launch of `_bucket_peer`; what `_bounded_send` saw."""
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    _two_members(_bucket_peer, extra=(report,))
    return report.get(timeout=60)


def test_weights_cross_the_link_in_buckets_bit_for_bit_with_their_checksums(bucket_pair):
    """Tensors cut into 1 KiB buckets (one larger than that alone in its own), packed,
    broadcast, and read back by name: equal to the sender's, bit for bit, with equal checksums
    per family."""
    layout = bucket_layout(_bucket_tensors(), 1024)
    assert [len(b) for b in layout] == [2, 1, 3]
    assert layout[1] == [("model.layers.0.t2.weight", (1000,))]


def test_a_sender_holds_one_tensor_and_at_most_four_buckets_never_the_model(bucket_pair):
    """docs/placement.md: each sending rank holds one tensor and at most four buckets in flight
    (64 MiB of 16 MiB buckets), never the whole model. A stream of 24 tensors in 12 buckets
    over a real gloo pair (`_bounded_send`): the sender's code never holds more than IN_FLIGHT
    buckets (the one it packs included), nor more tensors than the one it packs and the one
    being made, and it still packs a bucket while others are on the wire."""
    assert IN_FLIGHT * BUCKET_BYTES == 64 * 2**20  # the figure docs/placement.md gives
    seen = bucket_pair
    assert seen["of"] == 3 * IN_FLIGHT, seen  # holding them all would break the bound thrice
    assert 2 <= seen["buckets"] <= IN_FLIGHT, seen
    assert seen["tensors"] <= 2, seen


def _ahead_peer(member: int, port: int, errors, first_sent, second_sent) -> None:
    try:
        pg = _gloo_pair(member, port)
        tensors = _bucket_tensors()
        buckets = bucket_layout(tensors, 1024)
        if member == 0:  # the trainer: two whole updates, the second while the first is unloaded
            out = Outbox(pg)
            out.send({"op": "start", "dtype": "bf16"}, 1)
            msg = {"op": "weights", "version": 1, "buckets": buckets, "floor": True}
            out.send({**msg, "senders": [(0, len(buckets))]}, 1)
            timed_broadcasts(pg, buckets, torch.bfloat16)
            send_buckets(pg, tensors, buckets, torch.bfloat16, FamilySums())
            first_sent.set()  # the broadcasts have ended
            second = [(n, t + 1) for n, t in tensors]
            msg = {"op": "weights", "version": 2, "buckets": buckets, "floor": False}
            out.send({**msg, "senders": [(0, len(buckets))]}, 1)
            send_buckets(pg, second, buckets, torch.bfloat16, FamilySums())
            second_sent.set()
            out.send({"op": "stop"}, 1)
            out.flush()
            return
        # no engine: only the receiving side is exercised
        receiver = Receiver(Job(JobPlacement.split(1, 2, "separate", 1), link=pg))
        inbox = Inbox(pg, 0, last=lambda m: m["op"] == "stop", prepare=receiver.receive_ahead)
        # this (the engine's main) thread takes no message until the first update's broadcasts
        # have ended on the trainer: they did not wait for it
        assert first_sent.wait(60), "the trainer's broadcast waited for the engine's main thread"
        assert inbox.get()["op"] == "start"
        first = inbox.get()
        got = dict(bucket_items(buckets, first["flats"]))
        assert all(torch.equal(got[n], t) for n, t in tensors)
        # one update ahead at most: the second's bytes are not taken while the first is unloaded
        # (a wait that can only time out when the bound holds)
        assert not second_sent.wait(3), "a second update was received before the first loaded"
        receiver._ahead.release()  # what loading the first update does (Receiver.weights)
        assert second_sent.wait(60), "the second update's broadcast never ended"
        second = inbox.get()
        got = dict(bucket_items(buckets, second["flats"]))
        assert all(torch.equal(got[n], t + 1) for n, t in tensors)
        assert inbox.get()["op"] == "stop"
    except BaseException as e:  # reported to the test, which fails with it
        errors.put(f"member {member}: {type(e).__name__}: {e}")


def test_an_engine_receives_an_update_on_its_inbox_thread():
    """The trainer sends an update and broadcasts its bytes (and the floor's) while the engine's
    main thread takes no message: its inbox thread receives them, so the trainer's broadcast ends
    without the engine's work. A second update's bytes wait until the first is loaded (one copy
    of the weights received ahead, at most)."""
    ctx = mp.get_context("spawn")
    _two_members(_ahead_peer, extra=(ctx.Event(), ctx.Event()))


def _senders_peer(job_rank: int, port: int, errors) -> None:
    """Job rank `job_rank` of three, placed as a run places them: trainer ranks 0 and 1, each
    broadcasting its own share of the tensors over its own link, and one engine rank."""
    try:
        import os
        from datetime import timedelta

        import torch.distributed as dist

        os.environ.update(RANK=str(job_rank), WORLD_SIZE="3")
        store = dist.TCPStore("127.0.0.1", port, 3, is_master=job_rank == 0)
        job = init_job("gloo", "separate", 1, store, timedelta(seconds=60))
        where = job.placement
        tensors = _bucket_tensors()
        shares = {0: tensors[:2], 1: tensors[2:]}
        layouts = {r: bucket_layout(t, 1024) for r, t in shares.items()}
        if where.role == "train":
            r, out = where.rank, Outbox(job.link) if where.rank == 0 else None
            if r == 0:  # the order of the sync's messages, as `SeparateRollout` sends them
                out.send({"op": "start", "dtype": "bf16"}, 1)
                senders = [(s, len(b)) for s, b in layouts.items()]
                buckets = layouts[0] + layouts[1]
                msg = {"op": "weights", "version": 1, "floor": True, "buckets": buckets}
                out.send({**msg, "senders": senders}, 1)
            pg = job.sender_link(r)  # rank 0's is the link; rank 1's is made now, with the engine's
            assert (pg is job.link) == (r == 0)
            timed_broadcasts(pg, layouts[r], torch.bfloat16, r)
            sums = FamilySums()
            send_buckets(pg, shares[r], layouts[r], torch.bfloat16, sums, r)
            states: list | None = [None, None] if r == 0 else None
            dist.gather_object(sums.state(), states, dst=0)
            if r == 0:
                out.send({"op": "sums", "sums": merged(states)}, 1)
                out.send({"op": "stop"}, 1)
                out.flush()
            return
        receiver = Receiver(job)  # no engine: only the receiving side is exercised
        inbox = Inbox(job.link, 0, last=lambda m: m["op"] == "stop", prepare=receiver.receive_ahead)
        assert inbox.get()["op"] == "start"
        update = inbox.get()
        got = list(bucket_items(update["buckets"], update["flats"]))
        assert [n for n, _ in got] == [n for n, _ in tensors]
        sums = FamilySums()
        for (name, t), (_, want) in zip(got, tensors, strict=True):
            assert torch.equal(t, want), name
            sums.add(name, t)
        assert mismatched(inbox.get()["sums"], sums.state()) == []
        assert inbox.get()["op"] == "stop"
    except BaseException as e:  # reported to the test, which fails with it
        errors.put(f"job rank {job_rank}: {type(e).__name__}: {e}")


def test_two_trainer_ranks_send_their_own_tensors_over_their_own_links_at_once():
    """Two trainer ranks (two pipeline stages' first ranks) broadcast their shares over links
    of their own (`Job.sender_link`, rank 1's made at its first update by it and the engine); the
    engine receives both at once, in the order of the sync's bucket list, bit for bit, and the
    senders' checksums merged equal the engine's."""
    _two_members(_senders_peer, members=3)


def test_senders_checksums_merge_to_the_checksums_of_all_their_tensors():
    tensors = _bucket_tensors()
    whole, parts = FamilySums(), [FamilySums(), FamilySums(), FamilySums()]
    for i, (name, t) in enumerate(tensors):
        whole.add(name, t)
        parts[i % 3].add(name, t)
    assert merged([p.state() for p in parts]) == whole.state()
    assert merged([p.state() for p in parts[:2]]) != whole.state()


def test_the_link_carries_objects_and_broadcasts_between_two_processes():
    _two_members(_link_peer)


def _two_members(peer, members: int = 2, extra: tuple = ()) -> None:
    """`peer(member, port, errors, *extra)` in `members` processes (two: joined by a gloo link);
    fails with the first error one reports, or when one has not ended after 120 s (then every
    member still running is killed first)."""
    from megarl.distributed.launch import free_port

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=peer, args=(m, port, errors, *extra)) for m in range(members)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(120)
        hung = [m for m, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert errors.empty(), errors.get()
    assert hung == [], f"members {hung} had not ended after 120 s (killed)"
    assert [p.exitcode for p in procs] == [0] * members


def test_each_token_has_the_version_of_the_last_switch_at_or_before_it():
    # sampled 3 tokens with version 4, then an update to 5; a sample still queued at an update
    # switches at token 0 (every token the new version's)
    assert token_versions([(0, 4), (3, 5)], 6) == [4, 4, 4, 5, 5, 5]
    assert token_versions([(0, 4), (0, 5), (2, 6)], 4) == [5, 5, 6, 6]
    assert token_versions([(0, 4), (3, 5)], 2) == [4, 4]  # finished before the update reached it


def test_a_trajectory_keeps_each_turns_token_versions_and_gives_observations_the_last():
    from megarl.rollout.multi_turn.trajectory import Tokens

    tok = Tokens(prompt=[1])
    tok.add([5, 6], [-0.1, -0.2], 3)  # a turn sampled by one version
    tok.add([7], None)  # the environment's answer: the version of the turn before it
    tok.add([8, 9, 10], [-0.3] * 3, [3, 4, 4])  # streamed: an update in the middle of the turn
    tok.add([11], None)
    assert tok.versions == [3, 3, 3, 3, 4, 4, 4]
    assert tok.mask == [1, 1, 0, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="2 token versions for 3 tokens"):
        tok.add([1, 2, 3], [0.0] * 3, [4, 4])


def test_staleness_metrics_take_a_sample_as_old_as_its_oldest_token():
    ro = Samples.empty()
    ro.response_ids = [[1] * 4, [1] * 2, [1] * 3]
    ro.versions = Versions([[3, 3, 4, 4], [4, 4], [2, 2, 2]], staleness=[2, 1, 3])  # trainer at 5
    local = staleness_metrics(ro, max_staleness=3)
    ratio = {k: n / d for k, (n, d) in local.ratios.items()}
    assert ratio["rollout/staleness_mean"] == 2.0
    assert local.maxima["rollout/staleness_max"] == 3.0
    assert [ratio[f"rollout/staleness_share_{s}"] for s in range(4)] == [0, 1 / 3, 1 / 3, 1 / 3]
    # per token: 2, 2, 1, 1 | 1, 1 | 3, 3, 3 -> 17 / 9; one sample spans an update
    assert ratio["rollout/token_staleness_mean"] == 17 / 9
    assert ratio["rollout/inflight_share"] == 1 / 3
    assert staleness_metrics(ro, max_staleness=0).ratios == {}


@pytest.mark.parametrize(
    "overrides",
    [[], ["rollout.placement.mode=separate"], ["rollout.placement.max_staleness=1"]],
)
def test_config_refuses_inflight_updates_where_no_update_meets_a_generation(overrides):
    with pytest.raises(Exception, match="inflight_updates with rollout.placement.mode="):
        load_config(None, ["rollout.placement.inflight_updates=true", *overrides])
    if overrides == ["rollout.placement.mode=separate"]:  # what it asks for loads
        load_config(
            None,
            [
                "rollout.placement.inflight_updates=true",
                *overrides,
                "rollout.placement.max_staleness=1",
            ],
        )


@pytest.mark.parametrize("scheduler", ["waves", "stream"])
def test_config_takes_an_environment_with_separate_engines_and_inflight_updates(scheduler):
    env = [
        "rollout.placement.mode=separate",
        "env.name=tests.envs_for_tests:CopyAgain",
        f"env.scheduler={scheduler}",
    ]
    assert load_config(None, [*env, "rollout.placement.max_staleness=2"]).env.multi_turn
    inflight = [
        *env,
        "rollout.placement.max_staleness=1",
        "rollout.placement.inflight_updates=true",
    ]
    assert load_config(None, inflight).rollout.placement.inflight_updates


def test_samples_wait_for_the_syncs_before_them_and_those_their_tokens_carry():
    """pending: sync 1, request a, sync 2, request b, sync 3 (in the order sent). Request b's
    samples need syncs 1 and 2 (sent before it) and, once a token says sync 3 reached it while
    it generated (in-flight updates), sync 3 too; request a needs only sync 1 unless its tokens
    carry version 2 or 3."""
    s1, s2, s3 = (WeightsCheck(v, {}) for v in (1, 2, 3))
    pending = [s1, Request("a", [], []), s2, Request("b", [], []), s3]
    assert syncs_to_verify(pending, 3, newest=2) == [s1, s2]
    assert syncs_to_verify(pending, 3, newest=3) == [s1, s2, s3]
    assert syncs_to_verify(pending, 1, newest=1) == [s1]
    assert syncs_to_verify(pending, 1, newest=3) == [s1, s2, s3]
