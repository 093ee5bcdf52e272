"""benchmarks/disconnect_soak.py at a small size: clients that leave mid-stream get their requests aborted, and
afterwards nothing runs, every KV page is back and the server's process ends cleanly, its engine-core process
with it."""

from benchmarks.disconnect_soak import main


def test_a_soak_with_clients_leaving_leaves_every_page_back(tmp_path):
    result = main(["--requests", "60", "--concurrency", "8", "--leave-every", "3", "--json", str(tmp_path / "s.json")])
    assert result["abandoned"] == 20 and result["finished"] == 40
    assert result["after"]["num_requests_running"] == result["after"]["num_requests_waiting"] == 0
    assert result["after"]["kv_cache_usage_perc"] == 0
    assert 1 <= result["after"]["aborted_samples"] <= 20  # a client may leave after its request has finished
    assert result["kv_pages_free_at_stop"] == result["kv_pages_total"]
    assert result["server_exit_code"] == 0
    assert result["engine"] == "process" and result["child_processes"] >= 1 and result["processes_left"] == []
