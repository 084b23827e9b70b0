"""The profile diff at spike time, as pure computation: self and total shares, the ranking, when a culprit is
clear, and the merged flame tree; on recorded py-spy stacks (``tests/fixtures/profiles/``) and small cases."""

from __future__ import annotations

from spikehound.detectors import stack_diff
from spikehound.detectors.stack_diff import diff_stacks, judge, sentence
from spikehound.model import ProfileStack
from tests.support.profiles import windows

T0 = 1_750_000_000 * 10**9


def stack(*functions: str, samples: int, kind: str = "cpu") -> ProfileStack:
    """One stack of ``functions`` (root first), all in app.py, with the line varying by position."""
    return ProfileStack(host="gpu-1", service="preprocess", pid=1, process="python3", start_unix_nano=T0,
                        end_unix_nano=T0 + 10**10, frames=tuple((f, "app.py", 10 + i) for i, f in enumerate(functions)),
                        samples=samples, kind=kind)


def by_name(diff: stack_diff.StackDiff) -> dict[str, stack_diff.FunctionChange]:
    return {c.function: c for c in diff.changes}


def test_recorded_stacks_name_the_function_that_burns_the_extra_cpu():
    before = windows("preprocess-before.folded", T0, 30)
    during = windows("preprocess-spike.folded", T0 + 400 * 10**9, 12)
    diff = diff_stacks(during, before)
    assert (diff.samples_spike, diff.samples_baseline) == (628 * 12, 317 * 30)
    top = diff.changes[0]
    # Two lines of burn_cpu in the spike's stacks (181, 183), one before (180): one function.
    assert (top.function, top.file) == ("burn_cpu", "stack.py")
    assert top.self_samples_spike == (262 + 70) * 12 and top.self_samples_baseline == 19 * 30
    assert round(top.self_spike, 3) == round(332 / 628, 3) and round(top.self_baseline, 3) == round(19 / 317, 3)
    assert diff.culprit is top and diff.why_unclear is None
    assert sentence(top, "preprocess") == "burn_cpu in preprocess: 53% of samples during the spike against 6% before"
    # Its caller grew as much in total share, not at all in self share: ranked after it, never the culprit.
    caller = by_name(diff)["preprocess"]
    assert caller.self_spike == caller.self_baseline == 0
    assert round(caller.total_growth, 6) == round(top.total_growth + by_name(diff)["normalize"].total_growth, 6)
    assert diff.changes.index(caller) > 0
    # Everything else shrank in share: the shares of a period add up.
    assert round(sum(c.self_spike for c in diff.changes), 9) == 1.0
    assert all(c.self_growth <= 0 for c in diff.changes[1:])


def test_a_caller_grows_in_total_share_only_when_its_callee_gets_hot():
    before = [stack("main", "handle", "work", samples=80), stack("main", "handle", "io", samples=80),
              stack("main", "idle", samples=40)]
    during = [stack("main", "handle", "work", samples=160), stack("main", "handle", "io", samples=20),
              stack("main", "idle", samples=20)]
    diff = diff_stacks(during, before)
    changes = by_name(diff)
    assert changes["work"].self_spike == 0.8 and changes["work"].self_baseline == 0.4
    assert changes["handle"].self_spike == changes["handle"].self_baseline == 0.0
    assert changes["handle"].total_spike == 0.9 and changes["handle"].total_baseline == 0.8
    assert changes["main"].total_growth == 0  # the root is on every stack
    assert [c.function for c in diff.changes[:2]] == ["work", "handle"]
    assert diff.culprit is not None and diff.culprit.function == "work"
    assert sentence(changes["handle"], "preprocess", total=True) == (
        "handle in preprocess (with what it calls): 90% of samples during the spike against 80% before")


def test_recursion_counts_once_in_total_and_nests_in_the_flame_tree():
    during = [stack("main", "walk", "walk", "walk", "visit", samples=60), stack("main", "walk", samples=40)]
    before = [stack("main", "walk", "visit", samples=50), stack("main", "other", samples=50)]
    diff = diff_stacks(during, before)
    walk = by_name(diff)["walk"]
    assert walk.samples_spike == 100 and walk.total_spike == 1.0  # not 60 * 3 + 40
    assert walk.samples_baseline == 50 and walk.total_baseline == 0.5
    assert walk.self_samples_spike == 40 and walk.self_samples_baseline == 0
    tree = diff.tree.to_json()
    assert (tree["spike"], tree["baseline"]) == (100, 100)
    (main,) = tree["children"]
    first = main["children"][0]
    assert (first["function"], first["spike"], first["baseline"]) == ("walk", 100, 50)
    nested = first["children"][0]
    assert (nested["function"], nested["spike"], nested["baseline"]) == ("walk", 60, 0)
    assert [c["function"] for c in main["children"]] == ["walk", "other"]  # "other": baseline samples only


def test_without_a_baseline_the_changes_are_listed_but_no_culprit_is_named():
    diff = diff_stacks([stack("main", "burn", samples=300), stack("main", "io", samples=20)], [])
    assert diff.samples_baseline == 0
    assert diff.changes[0].function == "burn" and diff.changes[0].self_baseline == 0
    assert diff.culprit is None and diff.why_unclear == "only 0 samples before the spike (50 needed)"
    assert diff.tree.to_json()["children"][0]["baseline"] == 0


def test_tiny_sample_counts_name_no_culprit_however_large_the_change():
    diff = diff_stacks([stack("main", "burn", samples=9), stack("main", "io", samples=1)],
                       [stack("main", "io", samples=10)])
    assert diff.changes[0].function == "burn" and diff.changes[0].self_growth == 0.9
    assert diff.culprit is None and diff.why_unclear == "only 10 samples during the spike (50 needed)"
    # Enough samples, but the growth is noise-sized: 57 of 100 against 50 of 100 is 7 points.
    small = diff_stacks([stack("main", "burn", samples=57), stack("main", "io", samples=43)],
                        [stack("main", "burn", samples=50), stack("main", "io", samples=50)])
    assert small.culprit is None and "grew by 10 points" in (small.why_unclear or "")


def test_two_functions_that_grew_alike_are_not_one_culprit():
    before = [stack("main", "alloc", samples=50), stack("main", "gc", samples=50), stack("main", "io", samples=400)]
    during = [stack("main", "alloc", samples=150), stack("main", "gc", samples=130), stack("main", "io", samples=220)]
    diff = diff_stacks(during, before)
    assert [c.function for c in diff.changes[:2]] == ["alloc", "gc"]
    assert diff.culprit is None and diff.why_unclear == "alloc and gc grew alike (20 and 16 points)"


def test_a_growth_within_sampling_noise_is_not_a_culprit():
    # 16 points on 60 samples each: large, but z is about 1.8.
    during = [stack("main", "burn", samples=22), stack("main", "io", samples=38)]
    before = [stack("main", "burn", samples=12), stack("main", "io", samples=48)]
    culprit, why = judge(diff_stacks(during, before).changes, 60, 60)
    assert culprit is None and why is not None and "within sampling noise" in why


def test_the_flame_tree_drops_what_no_one_could_see():
    many = [stack("main", f"tiny{i}", samples=1) for i in range(300)] + [stack("main", "burn", samples=1000)]
    tree = diff_stacks(many, []).tree.to_json()
    (main,) = tree["children"]
    assert [c["function"] for c in main["children"]] == ["burn"]  # 1 of 1300 samples each: under 0.5%
    assert main["spike"] == 1300  # their samples stay in their parent's width


def test_kind_is_cpu_unless_only_wall_clock_samples_exist():
    assert stack_diff.pick_kind([stack("a", samples=1, kind="wall"), stack("a", samples=1)]) == "cpu"
    assert stack_diff.pick_kind([stack("a", samples=1, kind="wall")]) == "wall"


def test_a_comprehension_is_its_functions_own_code_on_every_python():
    # Python 3.11 samples a list comprehension in frames of its own (3.10 names them bare, 3.12 inlines them):
    # the function that runs it is what grew, in self share, and no frame named <listcomp> shows.
    py311 = ("handle", "burn_cpu", "burn_cpu.<locals>.<listcomp>", "burn_cpu.<locals>.<listcomp>.<listcomp>")
    py310 = ("handle", "burn_cpu", "<listcomp>", "<listcomp>")
    before = [stack("handle", "burn_cpu", samples=20), stack(*py311, samples=20), stack("handle", "parse", samples=60)]
    during = [stack("handle", "burn_cpu", samples=60), stack(*py310, samples=120), stack("handle", "parse", samples=60)]
    diff = diff_stacks(during, before)
    top = diff.changes[0]
    assert top.function == "burn_cpu"
    assert (top.self_samples_spike, top.self_samples_baseline) == (180, 40)
    assert not any("<listcomp>" in c.function for c in diff.changes)
    # A generator defined elsewhere and consumed here stays a frame of its own: it is not this function's code.
    other = stack("handle", "consume", "produce.<locals>.<genexpr>", samples=5)
    assert "produce.<locals>.<genexpr>" in by_name(diff_stacks([other], []))


def timed(leaf: str, samples: int, windows: int, start: int = T0) -> list[ProfileStack]:
    """``samples`` of a stack ending in ``leaf`` spread over ``windows`` 10 s windows of one process."""
    return [ProfileStack(host="gpu-1", service="preprocess", pid=1, process="python3",
                         start_unix_nano=start + w * 10**10, end_unix_nano=start + (w + 1) * 10**10,
                         frames=(("handle", "app.py", 1), (leaf, "app.py", 9)), samples=samples // windows)
            for w in range(windows)]


def test_a_function_that_already_dominated_is_named_when_its_cpu_time_multiplied():
    # burn_cpu was 73% of the samples before and is 85% during: a small change of share, within its noise at
    # these counts, but its own samples a second (its CPU time) went up fourfold, carrying the whole growth.
    before = timed("burn_cpu", 48, 6) + timed("parse", 18, 6)  # 60 s: 0.8 + 0.3 samples a second
    during = timed("burn_cpu", 60, 2) + timed("parse", 10, 2)  # 20 s: 3.0 + 0.5
    diff = diff_stacks(during, before)
    assert diff.culprit is not None and diff.culprit.function == "burn_cpu", diff.why_unclear
    assert round(diff.culprit.self_rate_spike / diff.culprit.self_rate_baseline, 2) == 3.75
    assert stack_diff.z_score(60, 70, 48, 66) < stack_diff.MIN_Z  # the share test alone would not say it


def test_twice_the_load_names_no_function():
    # Every function's samples a second doubled and no share moved: the load, not a function, changed.
    during = timed("burn_cpu", 160, 2) + timed("parse", 40, 2)  # 8 + 2 samples a second
    diff = diff_stacks(during, timed("burn_cpu", 240, 6) + timed("parse", 60, 6))  # 4 + 1
    assert diff.culprit is None


def test_a_share_that_grew_only_as_the_rest_shrank_is_not_a_culprit():
    # A thread reading a socket while its peer is slow: fewer samples a second than before, but everything else
    # fell further, so its share rose. Naming it would send the reader the wrong way.
    before = timed("readinto", 60, 6) + timed("encode", 240, 6)  # 1 + 4 samples a second
    during = timed("readinto", 48, 6) + timed("encode", 60, 6)  # 0.8 + 1
    diff = diff_stacks(during, before)
    top = diff.changes[0]
    assert top.function == "readinto" and top.self_growth > 0.2
    assert diff.culprit is None
    assert diff.why_unclear is not None and "grew only as the rest shrank" in diff.why_unclear
