"""@hotloop.memory_monitor: a train function (plain, generator or coroutine) run under a MemoryMonitor,
its report printed when the run ends."""
import functools
import inspect

from .monitor import MemoryMonitor


def memory_monitor(fn=None, *, interval_ms=1.0, device=None, model=None, report="table", file=None, plot=None,
                   **options):
    """Decorate a train function: its run is monitored and a MemoryReport is printed when it returns.

        @hotloop.memory_monitor
        def train(): ...

        @hotloop.memory_monitor(model=model, report="json", plot="memory.png")
        def train(): ...

    The function's return value and exceptions are unchanged; the last report is kept on
    `train.last_report`. On torch.OutOfMemoryError the report (with the failed request, free memory
    and fragmentation) is printed and attached to the exception as `err.hotloop_report`.
    Options are MemoryMonitor's: under torch.distributed, all_ranks=True (and process_group=) prints
    one table of every rank's peaks on the group's first rank, and nothing on the others.
    """
    if fn is not None and not callable(fn):
        raise TypeError(f"memory_monitor: expected a function or keyword options, got {fn!r}")

    def make():
        return MemoryMonitor(interval_ms=interval_ms, device=device, model=model, report=report, file=file,
                             plot=plot, **options)

    make()  # a bad option is an error where the decorator is written, not at the first call

    def decorate(func):
        if inspect.isasyncgenfunction(func):
            raise TypeError(f"memory_monitor: {func.__qualname__} is an async generator function, which it cannot "
                            "follow; decorate the function that iterates it")
        # a generator's or a coroutine's body runs when it is iterated or awaited, not when it is made:
        # the monitor runs across that
        if inspect.isgeneratorfunction(func):
            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                monitor = make()
                try:
                    with monitor:
                        return (yield from func(*args, **kwargs))
                finally:
                    wrapper.last_report = monitor.last_report
        elif inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def wrapper(*args, **kwargs):
                monitor = make()
                try:
                    with monitor:
                        return await func(*args, **kwargs)
                finally:
                    wrapper.last_report = monitor.last_report
        else:
            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                monitor = make()
                try:
                    with monitor:
                        return func(*args, **kwargs)
                finally:
                    wrapper.last_report = monitor.last_report

        wrapper.last_report = None
        return wrapper

    return decorate(fn) if fn is not None else decorate
