"""Write the rows of a committed megamoe-train-bench record back out as row files.

    python3 tools/record_rows.py bench/results/train/NAME.json .train-rows

A record is committed without its NAME.rows/ folder, so a later call that adds a backend,
precision or seed to it needs the old rows beside the new ones to merge them all:
tools/gpu_session.sh copies .train-rows/*.json into the call's rows folder, and
`megamoe-train-bench --merge --name NAME --out-dir DIR` merges a DIR/NAME.rows/ made here.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from megamoe.train.bench import _row_key, saved_row  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", type=Path, help="a megamoe-train-bench record (NAME.json)")
    parser.add_argument("out_dir", type=Path, help="folder for the row files")
    args = parser.parse_args()
    record = json.loads(args.record.read_text())
    rows = record.get("rows")
    if not rows:
        parser.error(f"record: {args.record} holds no rows")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for row in rows:
        row = saved_row(record, row)
        path = args.out_dir / f"{_row_key(row)}.json"
        path.write_text(json.dumps(row, indent=1) + "\n")
        print(path)


if __name__ == "__main__":
    main()
