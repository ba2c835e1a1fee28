"""``graphs/workflows/log_reading.py``: one line per format -> (level, service, message), and the signals.

Every line here is written for this test (none is copied from ``evals/incident_summary.jsonl``), so the
parser is checked on the shapes of the formats, not on the evaluation excerpts.
"""

from __future__ import annotations

import pytest

from elesium.graphs.workflows.log_reading import LogLine, error_kind, log_signals, parse_line

FORMATS = [
    # -- plain text with a service tag --------------------------------------------------------------
    ("tag-after-level",
     "2027-03-04T08:15:30Z ERROR [ledger-api] write to journal timed out after 812ms",
     "ERROR", "ledger-api", "write to journal timed out after 812ms"),
    ("tag-before-level",
     "2027-03-04T08:15:30.201Z [quota-svc] ERROR tenant t_88 exceeded burst budget",
     "ERROR", "quota-svc", "tenant t_88 exceeded burst budget"),
    ("python-comma-ms",
     "2027-03-04 08:15:30,114 CRITICAL [export-job] cannot open manifest s3://x/y.json",
     "FATAL", "export-job", "cannot open manifest s3://x/y.json"),
    ("level-service-colon",
     "2027-03-04 08:15:30 FATAL scheduler: lost leadership lease",
     "FATAL", "scheduler", "lost leadership lease"),
    ("winston",
     "2027-03-04T08:15:30.002Z error: upstream closed stream early",
     "ERROR", None, "upstream closed stream early"),
    # -- structured --------------------------------------------------------------------------------
    ("json",
     '{"time":"2027-03-04T08:15:30Z","level":"error","service":"tax-calc",'
     '"msg":"rate table missing for NO"}',
     "ERROR", "tax-calc", "rate table missing for NO"),
    ("json-nested-ecs",
     '{"@timestamp":"2027-03-04T08:15:30Z","log":{"level":"ERROR"},"service":{"name":"wallet"},'
     '"message":"balance snapshot stale by 41s"}',
     "ERROR", "wallet", "balance snapshot stale by 41s"),
    ("json-escaped-quotes",
     '{"level":"fatal","app":"cfg-loader","msg":"key \\"db.url\\" not set"}',
     "FATAL", "cfg-loader", 'key \\"db.url\\" not set'),
    ("pino",
     '{"level":50,"time":1800000000000,"pid":7,"hostname":"h1","name":"cart-bff","msg":"cart merge failed"}',
     "ERROR", "cart-bff", "cart merge failed"),
    ("bunyan-fatal",
     '{"name":"push-relay","level":60,"msg":"uncaught: socket closed","v":0}',
     "FATAL", "push-relay", "uncaught: socket closed"),
    ("pino-warn",
     '{"level":40,"name":"cart-bff","msg":"slow merge"}',
     "WARN", "cart-bff", "slow merge"),
    ("mongod",
     '{"t":{"$date":"2027-03-04T08:15:30.000+00:00"},"s":"E","c":"REPL","id":21235,"ctx":"rsSync",'
     '"msg":"Initial sync attempt failed","attr":{"attemptsLeft":9}}',
     "ERROR", None, "Initial sync attempt failed"),
    ("docker-json-envelope",
     '{"log":"2027-03-04T08:15:30Z ERROR [geo-ip] database file corrupt\\n","stream":"stderr"}',
     "ERROR", "geo-ip", "database file corrupt"),
    ("logfmt",
     'ts=2027-03-04T08:15:30Z level=error svc=fraud-score msg="model timeout, scoring skipped" p99=412',
     "ERROR", "fraud-score", "model timeout, scoring skipped"),
    ("logrus",
     'time="2027-03-04T08:15:30Z" level=fatal msg="raft log corrupted at index 8812" service=kv-store',
     "FATAL", "kv-store", "raft log corrupted at index 8812"),
    ("go-kit",
     'level=error ts=2027-03-04T08:15:30Z caller=sync.go:77 service=mirror msg="upstream 410 gone"',
     "ERROR", "mirror", "upstream 410 gone"),
    ("logrus-tty",
     "ERRO[0017] image pull failed                              image=web:2.1 attempt=3",
     "ERROR", None, "image pull failed"),
    # -- syslog and databases ----------------------------------------------------------------------
    ("syslog",
     "Mar  4 08:15:30 edge-7 cert-sync[3301]: ERROR renewal for *.shop.test rejected by CA",
     "ERROR", "cert-sync", "renewal for *.shop.test rejected by CA"),
    ("syslog-no-level",
     "Mar  4 08:15:30 edge-7 sshd[912]: Connection closed by 10.9.9.9 port 50022",
     "INFO", "sshd", "Connection closed by 10.9.9.9 port 50022"),
    ("postgres-syslog",
     'Mar  4 08:15:30 db-2 billing-pg[7711]: [12-1] ERROR:  relation "invoices_tmp" does not exist',
     "ERROR", "billing-pg", 'relation "invoices_tmp" does not exist'),
    ("postgres-stderr",
     "2027-03-04 08:15:30.441 UTC [9120] FATAL:  remaining connection slots are reserved",
     "FATAL", None, "remaining connection slots are reserved"),
    ("patroni",
     "2027-03-04 08:15:30,551 ERROR: failed to update leader key in etcd",
     "ERROR", None, "failed to update leader key in etcd"),
    ("mysql",
     "2027-03-04T08:15:30.118220Z 88 [ERROR] [MY-011071] [Server] Slave I/O for channel '': error",
     "ERROR", None, "[MY-011071] [Server] Slave I/O for channel '': error"),
    # -- JVM -----------------------------------------------------------------------------------------
    ("spring-boot-3",
     "2027-03-04T08:15:30.120Z ERROR 1 --- [loyalty] [nio-8080-exec-9] c.s.l.PointsService            : "
     "Points accrual failed for member 2231",
     "ERROR", "loyalty", "Points accrual failed for member 2231"),
    ("spring-boot-2",
     "2027-03-04 08:15:30.120 ERROR 1 --- [           main] o.s.boot.SpringApplication               : "
     "Application startup failed",
     "ERROR", None, "Application startup failed"),
    ("log4j-service-thread",
     "2027-03-04 08:15:30.120 ERROR [returns] [pool-3-thread-1] c.s.r.RefundJob - Refund batch aborted",
     "ERROR", "returns", "Refund batch aborted"),
    ("logback-thread-first",
     "08:15:30.120 [kafka-listener-2] ERROR c.s.r.EventHandler - Cannot decode event",
     "ERROR", None, "Cannot decode event"),
    ("elasticsearch",
     "[2027-03-04T08:15:30,120][ERROR][o.e.i.e.Engine] [es-warm-1] failed engine [merge failed]",
     "ERROR", None, "failed engine [merge failed]"),
    # -- Go ------------------------------------------------------------------------------------------
    ("zap-console",
     "2027-03-04T08:15:30.120Z\tERROR\troute-sync\tsync/apply.go:41\troute table apply failed"
     '\t{"routes": 12}',
     "ERROR", "route-sync", "route table apply failed"),
    ("zap-console-no-logger",
     "2027-03-04T08:15:30.120Z\terror\tcmd/main.go:9\tconfig invalid",
     "ERROR", None, "config invalid"),
    ("glog",
     "E0304 08:15:30.120331       1 leaderelection.go:330] error retrieving lease kube-system/sched",
     "ERROR", None, "error retrieving lease kube-system/sched"),
    ("klog-structured",
     'E0304 08:15:30.120331       1 controller.go:88] "Reconcile failed" err="conflict"',
     "ERROR", None, "Reconcile failed"),
    ("go-panic",
     "panic: assignment to entry in nil map",
     "FATAL", None, "assignment to entry in nil map"),
    # -- Python web and workers ----------------------------------------------------------------------
    ("gunicorn",
     "[2027-03-04 08:15:30 +0000] [1] [CRITICAL] WORKER TIMEOUT (pid:77)",
     "FATAL", None, "WORKER TIMEOUT (pid:77)"),
    ("uvicorn",
     "ERROR:    Exception in ASGI application",
     "ERROR", None, "Exception in ASGI application"),
    ("celery",
     "[2027-03-04 08:15:30,120: ERROR/ForkPoolWorker-2] Task mail.send[ab12] raised unexpected: "
     "SMTPDataError(451)",
     "ERROR", None, "Task mail.send[ab12] raised unexpected: SMTPDataError(451)"),
    ("airflow",
     "[2027-03-04T08:15:30.120+0000] {taskinstance.py:1937} ERROR - Task failed with exception",
     "ERROR", None, "Task failed with exception"),
    ("flask",
     "[2027-03-04 08:15:30,120] ERROR in app: Exception on /orders [POST]",
     "ERROR", None, "Exception on /orders [POST]"),
    ("python-basic",
     "ERROR:billing:charge retry budget exhausted",
     "ERROR", "billing", "charge retry budget exhausted"),
    ("python-dash",
     "2027-03-04 08:15:30,120 - reports - ERROR - pdf render crashed",
     "ERROR", "reports", "pdf render crashed"),
    ("thumbor",
     "2027-03-04 08:15:30 thumbor:ERROR [PIL_ENGINE] cannot identify image file",
     "ERROR", "thumbor", "[PIL_ENGINE] cannot identify image file"),
    ("structlog",
     "2027-03-04T08:15:30.120Z [error    ] webhook delivery failed        attempt=3 url=/x",
     "ERROR", None, "webhook delivery failed"),
    ("loguru",
     "2027-03-04 08:15:30.120 | ERROR    | app.jobs:run:44 - nightly sync crashed",
     "ERROR", None, "nightly sync crashed"),
    # -- other runtimes ------------------------------------------------------------------------------
    ("rails",
     "E, [2027-03-04T08:15:30.120331 #41] ERROR -- : PG::ConnectionBad (could not connect):",
     "ERROR", None, "PG::ConnectionBad (could not connect):"),
    ("laravel",
     '[2027-03-04 08:15:30] production.ERROR: Queue worker lost connection {"exception":"[object] x"} []',
     "ERROR", None, "Queue worker lost connection"),
    ("node-fatal-error",
     "FATAL ERROR: Ineffective mark-compacts near heap limit",
     "FATAL", None, "Ineffective mark-compacts near heap limit"),
    ("serilog",
     "[08:15:30 ERR] Payment provider responded 502",
     "ERROR", None, "Payment provider responded 502"),
    # -- proxies, DNS, agents ------------------------------------------------------------------------
    ("nginx-error",
     "2027/03/04 08:15:30 [error] 31#31: *4410 connect() failed (111: Connection refused) while connecting "
     'to upstream, client: 10.1.1.1, server: _, request: "GET / HTTP/1.1"',
     "ERROR", None, "connect() failed (111: Connection refused) while connecting to upstream"),
    ("nginx-emerg",
     '2027/03/04 08:15:30 [emerg] 1#1: unknown directive "proxy_pas" in /etc/nginx/nginx.conf:31',
     "FATAL", None, 'unknown directive "proxy_pas" in /etc/nginx/nginx.conf:31'),
    ("coredns",
     "[ERROR] plugin/errors: 2 api.internal. AAAA: dial udp 10.0.0.10:53: connect: network unreachable",
     "ERROR", None,
     "plugin/errors: 2 api.internal. AAAA: dial udp 10.0.0.10:53: connect: network unreachable"),
    ("fluent-bit",
     "[2027/03/04 08:15:30] [error] [output:http:http.1] no upstream connections available",
     "ERROR", None, "[output:http:http.1] no upstream connections available"),
    ("telegraf",
     "2027-03-04T08:15:30Z E! [inputs.snmp] Error in plugin: request timeout",
     "ERROR", None, "[inputs.snmp] Error in plugin: request timeout"),
    ("haproxy-alert",
     "Mar  4 08:15:30 lb-3 haproxy[402]: [ALERT]    (402) : backend 'be_app' has no server available!",
     "FATAL", "haproxy", "backend 'be_app' has no server available!"),
    # -- wrappers -----------------------------------------------------------------------------------
    ("kubectl-prefix",
     "[pod/invoice-7c5b9d8f6-q2w3e/invoice] 2027-03-04T08:15:30Z ERROR pdf queue full",
     "ERROR", "invoice", "pdf queue full"),
    ("kubectl-prefix-json",
     '[pod/queue-0/broker] {"level":"error","message":"disk watermark exceeded"}',
     "ERROR", "broker", "disk watermark exceeded"),
    ("docker-compose",
     "search-proxy-1  | 2027-03-04T08:15:30Z ERROR upstream pool drained",
     "ERROR", "search-proxy", "upstream pool drained"),
    ("compose-inner-tag-wins",
     "app-2  | 2027-03-04T08:15:30Z ERROR [order-intake] schema mismatch",
     "ERROR", "order-intake", "schema mismatch"),
    ("cri",
     "2027-03-04T08:15:30.120331Z stderr F 2027-03-04T08:15:30Z ERROR [cdn-sign] key not found",
     "ERROR", "cdn-sign", "key not found"),
    # -- lines that are not errors -------------------------------------------------------------------
    ("k8s-warning-event",
     "52s   Warning   Failed   pod/api-5d8-x7   Error: ErrImagePull",
     "INFO", None, "52s   Warning   Failed   pod/api-5d8-x7   Error: ErrImagePull"),
    ("node-exception-header",
     "Error: connect ECONNREFUSED 10.0.0.7:6379",
     "INFO", None, "Error: connect ECONNREFUSED 10.0.0.7:6379"),
    ("access-log",
     '10.0.0.7 - - [04/Mar/2027:08:15:30 +0000] "GET /health HTTP/1.1" 503 19 "-" "curl/8"',
     "INFO", None, '10.0.0.7 - - [04/Mar/2027:08:15:30 +0000] "GET /health HTTP/1.1" 503 19 "-" "curl/8"'),
    ("word-error-not-a-level",
     "error budget burn rate is 3x",
     "INFO", None, "error budget burn rate is 3x"),
]


@pytest.mark.parametrize("line,level,service,message", [f[1:] for f in FORMATS], ids=[f[0] for f in FORMATS])
def test_each_format_gives_level_service_and_message(line: str, level: str, service: str | None,
                                                     message: str) -> None:
    parsed = parse_line(line)
    assert parsed == LogLine(level, service, message)
    assert parsed.message in line  # quoted as it appears, never rewritten


def test_kinds_group_lines_that_differ_only_in_numbers_and_ids() -> None:
    assert error_kind("lease 7f1e2d3c-4b5a-4c6d-8e9f-a0b1c2d3e4f5 expired after 3012ms (node n-14)") == (
        error_kind("lease 0a1b2c3d-4e5f-4a6b-8c7d-e8f9a0b1c2d3 expired after 95ms (node n-2)"))
    assert error_kind("read udp 10.0.0.3:5512: timeout") == error_kind("read udp 10.0.0.9:60001: timeout")
    assert error_kind("A: lookup timed out") != error_kind("AAAA: lookup timed out")  # letters must match
    logs = "\n".join([
        "2027-03-04T08:15:30Z INFO [checkout] order o_1182 placed",
        "2027-03-04T08:15:31Z ERROR [checkout] stock reservation 4411 failed after 3001ms (req r-8a1f22)",
        "2027-03-04T08:15:32Z ERROR [checkout] coupon SPRING25 rejected",
        "2027-03-04T08:15:33Z ERROR [checkout] stock reservation 4502 failed after 2987ms (req r-0c9d31)",
        "2027-03-04T08:15:34Z WARN [checkout] retry queue 77% full",
        "2027-03-04T08:15:35Z ERROR [checkout] stock reservation 4419 failed after 3010ms (req r-77e0aa)",
    ])
    signals = log_signals(logs)
    # quoted as in the first line of its kind
    assert signals["top_error"] == "stock reservation 4411 failed after 3001ms (req r-8a1f22)"
    assert (signals["top_error_count"], signals["error"], signals["warn"], signals["lines"]) == (3, 4, 1, 6)


def test_stack_trace_continuations_are_not_errors_of_their_own() -> None:
    logs = "\n".join([
        "2027-03-04 08:15:30.120 ERROR [returns] [exec-1] c.s.r.RefundJob - Refund failed",
        "java.lang.IllegalStateException: ERROR ledger closed",
        "\tat com.shop.returns.RefundJob.run(RefundJob.java:51)",
        "\t... 12 more",
        "Caused by: java.io.IOException: ERROR broken pipe",
        "2027-03-04 08:15:31,004 ERROR [returns-py] Refund failed",
        "Traceback (most recent call last):",
        '  File "/srv/returns/job.py", line 12, in run',
        "    raise LedgerClosed()",
        "returns.errors.LedgerClosed: ERROR ledger closed",
        "[pod/returns-0/returns] Traceback (most recent call last):",
        '[pod/returns-1/returns] 2027-03-04T08:15:32Z ERROR [returns] Refund failed',
        '[pod/returns-0/returns]   File "/srv/returns/job.py", line 12, in run',
        "[pod/returns-0/returns] ValueError: ERROR: amount must be positive",
        "2027-03-04 08:15:33,004 WARNING [returns-py] retrying",
    ])
    signals = log_signals(logs)
    assert (signals["error"], signals["fatal"], signals["warn"]) == (3, 0, 1)
    assert signals["top_error"] == "Refund failed" and signals["top_error_count"] == 3


def test_a_traceback_cut_short_does_not_swallow_the_next_log_line() -> None:
    logs = "\n".join([
        "Traceback (most recent call last):",
        '  File "/srv/app.py", line 3, in <module>',
        "2027-03-04T08:15:30Z ERROR [api] database is locked",
    ])
    assert log_signals(logs)["top_error"] == "database is locked"


def test_emitter_is_the_service_with_most_error_lines_across_formats() -> None:
    logs = "\n".join([
        '{"level":"error","service":"gateway","msg":"upstream wallet 503"}',
        "wallet-1  | 2027-03-04T08:15:30Z ERROR [wallet] lock wait timeout on balances",
        "ts=2027-03-04T08:15:31Z level=error service=wallet msg=\"lock wait timeout on balances\"",
        '{"level":"error","service":"gateway","msg":"upstream wallet 503"}',
        "[pod/wallet-6f7d8c9b5-abcde/wallet] 2027-03-04T08:15:32Z FATAL lock wait timeout on balances",
        "2027-03-04T08:15:33Z ERROR [notifier] sms quota exhausted",
        "2027-03-04T08:15:34Z WARN [gateway] shedding load",
    ])
    signals = log_signals(logs)
    assert signals["emitter"] == "wallet"
    assert signals["top_error"] == "lock wait timeout on balances" and signals["top_error_count"] == 3
    assert (signals["error"], signals["fatal"]) == (5, 1)


def test_no_error_lines_means_no_top_error_and_no_emitter() -> None:
    logs = "\n".join([
        "2027-03-04T08:15:30Z INFO [search] query served in 41ms",
        "2027-03-04T08:15:31Z WARN [search] cache hit rate 61% below target",
        "W0304 08:15:32.000001       1 reflector.go:20] watch of *v1.Pod ended: too old resource version",
        "88s   Warning   Unhealthy   pod/search-5d8-x7   Readiness probe failed: HTTP probe failed: 500",
        '{"level":30,"name":"search","msg":"error budget report sent"}',
    ])
    signals = log_signals(logs)
    assert (signals["top_error"], signals["top_error_count"], signals["emitter"]) == ("", 0, "")
    assert (signals["error"], signals["fatal"], signals["warn"], signals["lines"]) == (0, 0, 2, 5)
