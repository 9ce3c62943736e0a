"""The image checker's own logic, without Docker: it runs the README tour's requests."""

from __future__ import annotations

from tests.e2e.image_checks import readme_curls


def test_the_readme_tour_curl_lines_aim_at_the_container() -> None:
    lines = readme_curls(18765)
    assert [line.split()[0] for line in lines] == ["curl"] * 4
    assert all("localhost:18765/" in line and "8765/" not in line.replace("18765", "") for line in lines)
    assert any("/v1/chat/completions" in line and "\\" not in line for line in lines)
