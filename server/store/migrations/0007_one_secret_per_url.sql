-- One secret per URL: subscriptions of the same URL (to different queues) had a secret each, so
-- the receiver there could verify only some of what it got. They now share the secret of the
-- oldest of them, which also signs notify_url and alert deliveries to that URL.
UPDATE subscriptions s SET secret = o.secret
FROM (SELECT DISTINCT ON (url) url, secret FROM subscriptions ORDER BY url, created_at, id) o
WHERE o.url = s.url AND s.secret <> o.secret;
