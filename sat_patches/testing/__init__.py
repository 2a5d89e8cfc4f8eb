"""Test support: run code on several CPU ranks over gloo, and tiny SAT models."""
from .multirank import RankResult, run_ranks, run_script, free_port, CPU_STANDINS, stock_disable

__all__ = ["RankResult", "run_ranks", "run_script", "free_port", "CPU_STANDINS", "stock_disable"]
