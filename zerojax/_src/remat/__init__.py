"""ZeRO-R's activation checkpoints as a wrapper for any block: which
intermediates are kept, Pa (split over a mesh axis), Pa+cpu (pinned host
memory). Reads nothing of zerojax."""
