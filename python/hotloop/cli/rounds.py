"""Two ways timed in alternated rounds, told apart: the ratio of the medians, and a word only where every
round of one way beat every round of the other (NOTE [ The demo's timing ] in demo.py). Used by the
demo's rounds (demo.py, demo_photos.py)."""
import statistics

# a verdict needs this many rounds: with fewer, one way can beat the other in every round by chance alone
VERDICT_ROUNDS = 3


def compare_rounds(hot, ref, higher_is_better):
    """(ratio, word) for one row's values per round: the ratio of the medians oriented so that > 1 means
    hotloop did better (None where a median is 0); 'better' or 'worse' only where every round of one way
    beat every round of the other, 'no clear difference' where the rounds' ranges overlap."""
    h, t = statistics.median(hot), statistics.median(ref)
    ratio = None if h <= 0 or t <= 0 else (h / t if higher_is_better else t / h)
    if len(hot) < VERDICT_ROUNDS or len(ref) < VERDICT_ROUNDS:
        return ratio, "too few rounds to say"
    sign = 1 if higher_is_better else -1  # scores: higher is better
    hot_scores, ref_scores = [sign * x for x in hot], [sign * x for x in ref]
    if min(hot_scores) > max(ref_scores):
        return ratio, "better"
    if max(hot_scores) < min(ref_scores):
        return ratio, "worse"
    return ratio, "no clear difference"


def print_table(rows):
    """The medians of (name, hotloop's values per round, torch's, higher_is_better) rows side by side, with
    the ratio and compare_rounds' word for each."""
    n = len(rows[0][1])
    width = max(22, 2 + max(len(name) for name, *_ in rows))
    print(f"  {f'median of {n} round' + ('s' if n > 1 else ''):{width}}{'hotloop':>12}{'torch':>12}  "
          f"{'better when':18}hotloop vs torch (>1x: hotloop better)")
    for name, h, t, higher in rows:
        ratio, word = compare_rounds(h, t, higher)
        print(f"  {name:{width}}{statistics.median(h):12.3f}{statistics.median(t):12.3f}  "
              f"{('higher' if higher else 'lower') + ' is better':18}"
              f"{'-' if ratio is None else f'{ratio:.2f}x'} {word}")


def verdict_line(h, t, what="loop"):
    """One line on the seconds per round of `what` (a loop, an epoch), hotloop's `h` and torch's `t`: who won
    and by how much, or that the rounds do not say."""
    ratio, word = compare_rounds(h, t, higher_is_better=False)
    where = f"medians of {len(h)} rounds"
    if word == "better":
        return (f"verdict: hotloop won: its {what} ran {ratio:.2f}x as fast as torch's ({where}; every hotloop round "
                "faster)")
    if word == "worse":
        return (f"verdict: torch won: hotloop's {what} ran {ratio:.2f}x as fast as torch's, slower ({where}; every "
                "torch round faster)")
    if word == "no clear difference":
        return (f"verdict: no clear difference in {what} time: the rounds' ranges overlap (hotloop {min(h):.2f}-"
                f"{max(h):.2f} s, torch {min(t):.2f}-{max(t):.2f} s)")
    return f"verdict: none from {len(h)} round{'s' if len(h) > 1 else ''} (--rounds {VERDICT_ROUNDS} or more for one)"
