"""``python -m acco_ds.ops``: build the native ops if needed and report on them."""

from . import op_report

if __name__ == "__main__":
    print(f"{'op':<16}{'device':<8}{'compatible':<12}{'AOT built':<11}{'loadable':<10}{'load s':<8}auto uses")
    for row in op_report():
        print(f"{row['op']:<16}{row['device']:<8}{str(row['compatible']):<12}{str(row['aot_built']):<11}"
              f"{str(row['loadable']):<10}{str(row.get('load_s', '-')):<8}{row['auto_uses']}" +
              (f"   ({row['error']})" if "error" in row else ""))
