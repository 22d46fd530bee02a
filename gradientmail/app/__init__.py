"""Applications built on the library: the `gradientmail` command (`cli`), its demo
(`demo`, on `gradientmail.integration.textdata`), and the read-only tools over a run's
bucket (`verify`, `history`)."""

__all__: list[str] = []
