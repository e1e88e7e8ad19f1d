"""hotloop's benchmarks: per component a module whose rows(ctx) yields Row objects (harness.py),
run by `python -m hotloop bench components` (hotloop/cli/bench.py). They use hotloop's public API."""

# component name -> module with rows(ctx); each component issue adds its line
COMPONENTS = {
    "ops": "hotloop.bench.ops",
    "scaler": "hotloop.bench.scaler",
    "optim": "hotloop.bench.optim",
    "monitor": "hotloop.bench.monitor",
    "loader": "hotloop.bench.loader",
    "images": "hotloop.bench.images",
    "photos": "hotloop.bench.image_loop",
    "photos-engines-off": "hotloop.bench.photo_backends",
    "photos-12mp": "hotloop.bench.photos_large",
    "startup": "hotloop.bench.startup",
}
