"""Root-to-node paths of a tree verify row, written independently of the engine's (a test reference)."""


def path_of(parents: list[int], i: int) -> list[int]:
    """Rows from the root (row 0, parent -1) down to row i of a row's parents list."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]
