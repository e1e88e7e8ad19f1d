"""find_max_batch_size's search: from the trials so far (size, peak memory, ran or not), the margin and
bracket they justify and the next size to try (batch_size.py's docstring says how)."""
import math


def _line_fit(points):
    """Least squares peak = a + b·size over (size, peak) points; and the residuals' standard deviation
    (0 with two points, which a line always passes through). None with fewer than two sizes."""
    n = len(points)
    if len({s for s, _ in points}) < 2:
        return None
    ms = sum(s for s, _ in points) / n
    mp = sum(p for _, p in points) / n
    sxx = sum((s - ms) ** 2 for s, _ in points)
    b = sum((s - ms) * (p - mp) for s, p in points) / sxx
    a = mp - b * ms
    sigma = math.sqrt(sum((p - a - b * s) ** 2 for s, p in points) / (n - 2)) if n > 2 else 0.0
    return a, b, sigma


def _crossing(predict, lo, upper, usable):
    """The largest size in [lo, upper] whose predicted peak stays within usable (lo when none does)."""
    if predict(upper) <= usable:
        return upper
    while upper - lo > 1:
        mid = (lo + upper) // 2
        lo, upper = (mid, upper) if predict(mid) <= usable else (lo, mid)
    return lo


def _through(points, curved):
    """The parabola through the last three (size, peak) points where they curve upwards and curved is
    set, else the line through the last two."""
    if curved and len(points) >= 3:
        (sa, pa), (sb, pb), (sc, pc) = points[-3:]
        d0, d1 = (pb - pa) / (sb - sa), (pc - pb) / (sc - sb)
        curve = (d1 - d0) / (sc - sa)
        if curve > 0 and d1 > 0:
            return lambda x: pc + d1 * (x - sc) + curve * (x - sc) * (x - sb)
    (s0, p0), (s1, p1) = points[-2:]
    return lambda x: p1 + (p1 - p0) / (s1 - s0) * (x - s1)


class Search:
    """The state of one search: trials so far, the margin and bracket they justify, the next size."""

    def __init__(self, start, max_batch_size, headroom):
        self.start, self.max_batch_size, self.headroom = start, max_batch_size, headroom
        self.trials = []
        self.capacity = None
        self.baseline = 0
        self.fit = None
        self.margin = 0

    def add(self, trial, capacity):
        self.trials.append(trial)
        # the smallest capacity seen: cuDNN/cuBLAS handles made by the first trial, or another process,
        # take memory the allocator cannot have
        self.capacity = capacity if self.capacity is None else min(self.capacity, capacity)
        self.fit = _line_fit(self.ran())
        self.margin = self.margin_with(self.fit)

    def ran(self, hi=None):
        """(size, peak) of the trials that ran, at or below hi, by size."""
        return sorted({t.batch_size: t.peak_bytes for t in self.trials
                       if not t.oom and (hi is None or t.batch_size <= hi)}.items())

    def margin_with(self, fit):
        # a fixed share of the capacity (fragmentation that a longer run adds, a cuDNN algorithm with a
        # larger workspace) or three standard deviations of the measured peaks about the fitted line,
        # whichever is larger: where peaks are noisy or not linear the fit is trusted less
        return int(max(self.headroom * self.capacity, 3 * (fit[2] if fit else 0.0)))

    def fits(self, trial):
        return not trial.oom and trial.peak_bytes <= self.capacity - self.margin

    def bracket(self):
        """(largest size that fits, smallest larger size that does not or is not allowed, or None)"""
        ok = [t.batch_size for t in self.trials if self.fits(t)]
        lo = max(ok) if ok else None
        over = [t.batch_size for t in self.trials if not self.fits(t) and (lo is None or t.batch_size > lo)]
        if self.max_batch_size is not None:
            over.append(self.max_batch_size + 1)
        return lo, (min(over) if over else None)

    def model(self, hi):
        """The peak the next guess expects at a size: a function of the size, built from the largest
        sizes that ran at or below hi (near the limit they follow the peaks more closely than the fit
        over all of them, where a step or a curve bends the line)."""
        ran = self.ran(hi)
        if len(ran) == 1:
            # one size has run: its growth over what was held before it (model, optimizer state) is at
            # most b·size, so the line through the baseline overestimates the slope and underestimates
            # the limit
            size, peak = ran[0]
            return lambda x: self.baseline + (peak - self.baseline) * x / size
        # inside a bracket, peaks that curve upwards (allocator rounding, a larger workspace) are
        # followed by the parabola through the three largest sizes; a line would aim short of the limit
        curved = hi is not None
        below = _through(ran[:-1], curved) if len(ran) >= 4 else None
        top, peak = ran[-1]
        if below is not None and peak - below(top) > self.margin_with(_line_fit(ran[:-1])):
            # the largest size stepped above what the sizes below it predict, by more than the margin
            # they justify (cuDNN picked an algorithm with a larger workspace, the allocator the next
            # block size): the sizes below keep the slope, the step moves it up
            return lambda x: below(x) + peak - below(top)
        return _through(ran, curved)

    def resolution(self, lo, hi, predict):
        # searching closer than 1/64 of the size costs trials for under 1.6% more batch; and where the
        # margin is three standard deviations, it is itself known only to about 3σ/sqrt(2(n - 2)) (the
        # standard error of a standard deviation from n - 2 degrees of freedom): where the bracket
        # holds the size at which the peaks cross the usable memory, searching closer than the samples
        # that memory buys across it chases the margin's noise, as each trial moves it
        step = max(1, lo // 64)
        n = len(self.ran())
        if n > 2 and hi is not None and predict(hi) > self.capacity - self.margin:
            per_sample = (predict(hi) - predict(lo)) / (hi - lo)
            if per_sample > 0:
                step = max(step, int(3 * self.fit[2] / math.sqrt(2 * (n - 2)) / per_sample))
        return step

    def split(self, lo, hi):
        """A size between lo and hi when the peaks below lo say nothing about where the limit is."""
        # every octave between them is as likely to hold the limit as the next: halve the octaves, then,
        # inside one octave, the sizes. The octaves are those that doubling from start walks: at each of
        # its sizes doubling + bisection (the yardstick) needs more trials for a limit just above than
        # just below, so a split there sets apart limits that cost it fewer trials; against that count
        # it saves up to a trial over splitting at the geometric mean
        k_lo, k_hi = math.log2(lo / self.start), math.log2(hi / self.start)
        ks = [k for k in range(math.floor(k_lo) + 1, math.ceil(k_hi)) if lo < self.start << k < hi]
        if ks:
            return self.start << min(ks, key=lambda k: abs(k - (k_lo + k_hi) / 2))
        return (lo + hi) // 2

    def next_size(self):
        """The size to try next, or None when the bracket is narrow enough."""
        lo, hi = self.bracket()
        if lo is None:
            return None
        predict = self.model(hi)
        step = self.resolution(lo, hi, predict)
        if hi is not None and hi - lo <= step:
            return None
        last = next((t for t in self.trials if t.batch_size == hi), None)
        if last is not None and last.oom and predict(hi) <= self.capacity - self.margin / 2:
            # the peaks said hi would run with room to spare (more than half the margin: less is within
            # what the margin is there for), and it ran out of memory: something above lo that the
            # peaks below it do not show (a cuDNN workspace, an allocator step) sets the limit, and a
            # line refitted through them would aim at hi again: search the bracket instead
            return self.split(lo, hi)
        # a line through two sizes close together, extrapolated far, carries their noise with it: go at
        # most 16 times past the largest size that ran, and let that trial steady the line
        upper = min(16 * self.ran(hi)[-1][0], hi or math.inf)
        guess = _crossing(predict, lo, upper, self.capacity - self.margin)
        # the trial itself will move the margin (on curving peaks it shrinks as sizes near the limit
        # add points the line fits well): aim where the limit will be once it is counted
        for _ in range(3):
            fit = _line_fit(self.ran() + [(guess, predict(guess))])
            guess = _crossing(predict, lo, upper, self.capacity - self.margin_with(fit))
        # the guess says lo is the limit: confirm with a size just above it; or that a trial at hi is:
        # a size just below it (max_batch_size itself where that is hi); where the two overlap, either
        # answer ends the search
        low = lo + step
        if hi is None:
            return max(guess, low)
        high = hi - (step if last is not None else 1)
        if low <= high:
            return min(max(guess, low), high)
        return min(max(guess, high), low)
