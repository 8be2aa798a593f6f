"""Reference models written to run under every ZeRO stage."""
