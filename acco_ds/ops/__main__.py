"""``python -m acco_ds.ops``: build (if needed) and report the native ops."""

from . import op_report

if __name__ == "__main__":
    for row in op_report():
        print("  ".join(f"{k}={v}" for k, v in row.items()))
