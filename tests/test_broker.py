"""llmq's broker transport (app/broker.py) on a real Redis: one shared client per connection pool,
and messages still go through it from many threads at once."""
import threading

from kombu import Connection, Exchange, Queue

from llmq.broker import Transport


def test_the_channel_builds_one_client_per_pool(redis_db, redis_url):
    with Connection(redis_url, transport=Transport) as connection:
        channel = connection.default_channel
        client = channel._create_client()
        assert channel._create_client() is client
        with channel.conn_or_acquire() as acquired:
            assert acquired is client
        channel._disconnect_pools()  # what kombu does when the connection to Redis is lost
        renewed = channel._create_client()
        assert renewed is not client
        assert renewed.connection_pool is channel.pool
        assert renewed.ping()


def test_messages_from_many_threads_all_arrive(redis_db, redis_url):
    queue = Queue("llmq.test-broker", Exchange("llmq.test-broker", type="direct"), routing_key="llmq.test-broker")
    with Connection(redis_url, transport=Transport) as connection:
        queue(connection.default_channel).declare()

        def send(sender: int) -> None:
            with connection.Producer() as producer:
                for n in range(25):
                    producer.publish({"sender": sender, "n": n}, exchange=queue.exchange,
                                     routing_key=queue.routing_key, serializer="json")

        senders = [threading.Thread(target=send, args=(s,)) for s in range(8)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        received = set()
        bound = queue(connection.default_channel)
        while (message := bound.get(no_ack=True)) is not None:
            received.add((message.payload["sender"], message.payload["n"]))
    assert received == {(s, n) for s in range(8) for n in range(25)}
