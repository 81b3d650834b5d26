"""SLIM, the skill library as a training variable (docs/signal_methods.md, "SLIM"): the library and
its rules (`library`), its texts (`text`), its trainer side (`runner`) and the report's section
(`report`)."""
