"""API keys and tenants: the api_keys table; a tenant on requests, files and batches

Rows made before this revision belong to tenant "default" (the server default), which is the tenant
an install without keys runs as, so upgrading changes nothing a client sees until the first key.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 19:00:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0002'
down_revision: Union[str, Sequence[str], None] = '0001'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

TENANT_TABLES = ('requests', 'files', 'batches')


def upgrade() -> None:
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('display_prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.Column('revoked_at', sa.Double(), nullable=True),
    sa.Column('rate_limit_rpm', sa.Integer(), nullable=True),
    sa.Column('rate_limit_tpm', sa.Integer(), nullable=True),
    sa.Column('max_upload_bytes', sa.Integer(), nullable=True),
    sa.Column('max_batch_lines', sa.Integer(), nullable=True),
    sa.Column('max_tokens', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key_hash')
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_tenant'), ['tenant'], unique=False)

    for table in TENANT_TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('tenant', sa.String(length=64), server_default='default', nullable=False))
            batch_op.create_index(batch_op.f(f'ix_{table}_tenant'), ['tenant'], unique=False)


def downgrade() -> None:
    for table in reversed(TENANT_TABLES):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(batch_op.f(f'ix_{table}_tenant'))
            batch_op.drop_column('tenant')

    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_tenant'))

    op.drop_table('api_keys')
