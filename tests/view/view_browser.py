#!/usr/bin/env python3
"""kvlab view in a real browser: Debian's chromium, headless, driven by selenium (PyPI).

usage: view_browser.py KVLAB SOURCE_DIR OUT_DIR [--screenshot FILE]
Runs experiments/quickstart.toml, writes its view, opens it and checks:
  - the page loads with no console errors;
  - moving the clock to a step shows that step: the pool map's slot counts (drawn from
    frames.jsonl) equal steps.csv's kv_used / kv_reserved_unused / kv_last_block_slack /
    kv_cached_free at that step, for both runs side by side;
  - its screenshot at the quickstart's step 40 (--screenshot).
Also: kvlab view's errors for a folder that is not a results folder; a hostile results folder
(markup and script in labels, events and frames, a frame that would take the pool map 10^15
cells, summary numbers as strings): nothing of it runs, its strings show as text, the page draws
the rest and says what it left out; and kvlab serve's /ui (live, on 127.0.0.1 only, 12
requests, the server stops by itself) with --ui full (the page follows the server's steps, and a
pool frame's slot counts equal its step's KV numbers) and by default (aggregates: no pool, no
requests; the page says what is withheld).
"""
import csv
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service


def fail(message):
    print("FAIL:", message)
    sys.exit(1)


def steps_csv(folder):
    with open(os.path.join(folder, "steps.csv"), newline="") as f:
        return {int(row["step"]): row for row in csv.DictReader(f)}


def browser():
    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1500", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def check_step(driver, results, runs, step):
    driver.execute_script("window.kvlabView.setStep(0, arguments[0]);", step)
    state = driver.execute_script("return window.kvlabView.state();")
    if state[0]["step"] != step:
        fail(f"the clock at step {step} of the first run shows step {state[0]['step']}")
    for panel, run in zip(state, runs):
        table = steps_csv(os.path.join(results, run["dir"]))
        shown = panel["step"]
        if panel["frameStep"] != shown:
            fail(f"{run['dir']}: step {shown} drew the pool of step {panel['frameStep']}")
        want = table[shown]
        counts = {k: int(v) for k, v in panel["counts"].items()}
        for column, key in (("kv_used", "live"), ("kv_reserved_unused", "reserved"),
                            ("kv_last_block_slack", "slack"), ("kv_cached_free", "cached")):
            if counts.get(key, 0) != int(want[column]):
                fail(f"{run['dir']} step {shown}: the map shows {key} {counts.get(key, 0)}, "
                     f"steps.csv's {column} is {want[column]}")
    return state


def main():
    kvlab, source, out = sys.argv[1:4]
    screenshot = sys.argv[sys.argv.index("--screenshot") + 1] if "--screenshot" in sys.argv else None
    results = os.path.join(out, "quickstart")
    subprocess.run([kvlab, "run", os.path.join(source, "experiments/quickstart.toml"), "--out",
                    results], check=True, stdout=subprocess.DEVNULL)
    page = os.path.join(out, "quickstart.html")
    subprocess.run([kvlab, "view", results, "--out", page], check=True)
    bad = subprocess.run([kvlab, "view", source], capture_output=True, text=True)
    if bad.returncode == 0 or "runs.json" not in bad.stderr:
        fail(f"kvlab view of a folder that is not a results folder: {bad.returncode} {bad.stderr}")

    with open(os.path.join(results, "runs.json")) as f:
        runs = json.load(f)
    driver = browser()
    try:
        started = time.monotonic()
        driver.get("file://" + os.path.abspath(page))
        loaded = driver.execute_script("return window.kvlabView !== undefined;")
        print(f"page loaded in {time.monotonic() - started:.2f} s")
        if not loaded:
            fail("the page's script did not start")
        for step in (0, 10, 40, 75):
            state = check_step(driver, results, runs, step)
            print(f"step {step}: " + "; ".join(
                f"{p['run']} at step {p['step']}: {p['counts']}" for p in state))
        # The slider itself (an input event, as a drag sends): at step 40's time of the first run
        # the map shows step 40 as steps.csv has it, and at its end the last step.
        table = steps_csv(os.path.join(results, runs[0]["dir"]))
        slide = ("const c = document.getElementById('clock'); c.value = arguments[0]; "
                 "c.dispatchEvent(new Event('input'));")
        driver.execute_script(slide, float(table[40]["start_s"]))
        state = driver.execute_script("return window.kvlabView.state();")[0]
        want = table[40]
        if state["step"] != 40 or int(state["counts"]["live"]) != int(want["kv_used"]) or \
                int(state["counts"]["slack"]) != int(want["kv_last_block_slack"]):
            fail(f"the slider at step 40's time shows {state}; steps.csv: kv_used "
                 f"{want['kv_used']}, slack {want['kv_last_block_slack']}")
        driver.execute_script(slide, driver.execute_script(
            "return Number(document.getElementById('clock').max);"))
        last = driver.execute_script("return window.kvlabView.state();")[0]["step"]
        if last != max(table):
            fail(f"the slider at its end shows step {last}, the run's last is {max(table)}")
        if screenshot:
            driver.execute_script("window.kvlabView.setStep(1, 40);")
            driver.save_screenshot(screenshot)
            print("screenshot:", screenshot)
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        if errors:
            fail(f"console errors: {errors}")
    finally:
        driver.quit()
    check_hostile(kvlab, results, out)
    check_live(kvlab, source, out, "full")
    check_live(kvlab, source, out, "aggregate")
    print("kvlab view in chromium: OK")


PAYLOAD = '<img src=x onerror="window.kvlabPwned=1">'


def check_hostile(kvlab, results, out):
    """A results folder someone crafted: nothing of it may run, hang or blank the page."""
    folder = os.path.join(out, "hostile")
    shutil.copytree(results, folder)
    with open(os.path.join(folder, "runs.json")) as f:
        runs = json.load(f)
    runs[0]["label"] = "</script><!--<script>window.kvlabPwned=2</script>" + PAYLOAD
    with open(os.path.join(folder, "runs.json"), "w") as f:
        json.dump(runs, f)
    run = os.path.join(folder, runs[0]["dir"])
    with open(os.path.join(run, "frames.jsonl")) as f:
        frames = [json.loads(line) for line in f if line.strip()]
    frames[1]["batch"] = [[PAYLOAD, 5, 0, 0, 0]]              # markup as a request id
    frames[2]["tiers"] = [PAYLOAD, 1, 0, 0]                   # ... as a tier's count
    frames[3]["runs"] = [[0, 10**15, 0, "used"]]              # 10^15 slots: a hang
    frames[4]["runs"] = [[0, 4, 0, PAYLOAD]]                  # an unknown state
    with open(os.path.join(run, "frames.jsonl"), "w") as f:
        f.writelines(json.dumps(frame) + "\n" for frame in frames)
    with open(os.path.join(run, "events.jsonl"), "a") as f:
        f.write(json.dumps({"step": 0, "event": PAYLOAD, "request": 1, "reason": "<script>x"}) + "\n")
    with open(os.path.join(run, "summary.json"), "w") as f:
        json.dump({"ttft_s": {"mean": "fast"}, "output_tokens_per_s": PAYLOAD}, f)
    page = os.path.join(out, "hostile.html")
    subprocess.run([kvlab, "view", folder, "--out", page], check=True, stdout=subprocess.DEVNULL)
    driver = browser()
    try:
        driver.set_script_timeout(20)
        driver.set_page_load_timeout(60)
        driver.get("file://" + os.path.abspath(page))
        if not driver.execute_script("return window.kvlabView !== undefined;"):
            fail("the hostile page's script did not start")
        for step in (0, 1, 2, 3, 4, 5):  # each crafted frame drawn, within the script timeout
            driver.execute_script("window.kvlabView.setStep(0, arguments[0]);", step)
        pwned = driver.execute_script("return window.kvlabPwned;")
        images = driver.execute_script("return document.querySelectorAll('img').length;")
        if pwned is not None or images:
            fail(f"the hostile folder's markup ran: kvlabPwned={pwned}, {images} img elements")
        shown = driver.execute_script("return document.body.innerText;")
        label = driver.execute_script("return document.getElementById('run-a').options[0].text;")
        if label != runs[0]["label"]:
            fail(f"the run's label is not shown as its text: {label!r}")
        driver.execute_script("window.kvlabView.setStep(0, 0);")
        shown = driver.execute_script("return document.body.innerText;")
        if PAYLOAD not in shown:
            fail("the crafted event's kind is not shown as text at step 0")
        problems = driver.execute_script("return window.kvlabView.problems();")
        if "3 malformed pool frames left out" not in problems:
            fail(f"the page does not say what it left out: {problems!r}")
        state = driver.execute_script("return window.kvlabView.state();")
        if state[0]["step"] != 0 or state[1]["frameStep"] != 0:
            fail(f"the hostile page does not draw the rest: {state}")
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        if errors:
            fail(f"console errors on the hostile page: {errors}")
        print(f"hostile folder: nothing ran; {problems}")
    finally:
        driver.quit()


def check_live(kvlab, source, out, ui):
    server = subprocess.Popen(
        [kvlab, "serve", os.path.join(source, "experiments/quickstart.toml"), "--port", "0",
         "--max-seconds", "60", "--api-key", "k3y", "--out", os.path.join(out, "served_" + ui),
         "--set", 'scheduler.name="fcfs"', "--ui", ui],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        for line in server.stdout:
            if "http://127.0.0.1:" in line:
                port = int(line.split("http://127.0.0.1:")[1].split()[0])
                break
        if port is None:
            fail("kvlab serve did not say its port")
        threading.Thread(target=lambda: [l for l in server.stdout], daemon=True).start()
        body = {"model": "stories15m", "prompt": list(range(1, 40)), "max_tokens": 48}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": "Bearer k3y"})
        clients = [threading.Thread(target=urllib.request.urlopen, args=(request,),
                                    kwargs={"timeout": 30}) for _ in range(12)]
        driver = browser()
        try:
            driver.get(f"http://127.0.0.1:{port}/ui?api_key=k3y")
            for c in clients:
                c.start()
            for c in clients:
                c.join()
            time.sleep(2.5)  # the page polls /ui/data every second
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui/data?api_key=k3y") as r:
                data = json.load(r)["runs"][0]
            steps = data["steps"]
            state = driver.execute_script("return window.kvlabView.state();")[0]
            if not steps["step"] or state["step"] != steps["step"][-1]:
                fail(f"/ui shows step {state['step']}, the server's last is "
                     f"{steps['step'][-1] if steps['step'] else None}")
            if ui == "aggregate":
                note = driver.find_element("id", "note").text
                if "used" in steps or data["frames"] or data["requests"]["id"] or \
                        "Withheld" not in note or state["frameStep"] != -1:
                    fail(f"/ui by default shows more than aggregates: {sorted(steps)}, "
                         f"{len(data['frames'])} frames; the page says {note!r}")
                errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
                if errors:
                    fail(f"console errors on /ui (aggregate): {errors}")
                print(f"live /ui, aggregate: {len(steps['step'])} steps; {note}")
                return
            frame = data["frames"][len(data["frames"]) // 2]
            driver.execute_script("window.kvlabView.setStep(0, arguments[0]);", frame["step"])
            state = driver.execute_script("return window.kvlabView.state();")[0]
            at = steps["step"].index(frame["step"])
            counts = {k: int(v) for k, v in state["counts"].items()}
            if state["frameStep"] != frame["step"] or counts["live"] != steps["used"][at] or \
                    counts["slack"] != steps["slack"][at]:
                fail(f"/ui at step {frame['step']}: {state}; the step's used "
                     f"{steps['used'][at]}, slack {steps['slack'][at]}")
            print(f"live /ui: {len(steps['step'])} steps, {len(data['frames'])} frames; step "
                  f"{frame['step']}: {state['counts']}")
            errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
            if errors:
                fail(f"console errors on /ui: {errors}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ui/data?api_key=wrong")
                fail("/ui/data answered without the key")
            except urllib.error.HTTPError as e:
                if e.code != 401:
                    fail(f"/ui/data without the key: {e.code}, not 401")
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
